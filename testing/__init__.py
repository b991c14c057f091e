"""strata.testing: deterministic synthetic GGUF files for strata's tests and benchmarks.

Not part of the toolchain itself (nothing in ``strata.packer``, ``strata.budget`` or
``strata.engine`` imports it); it makes the files those are tested on. Everything is seeded: the
same arguments give byte-identical files. Nine modules, one job each:

- :mod:`.blocks` - :func:`make_random_blocks`: valid random blocks of any ggml type (quantized from
  random normal values where gguf-py has a quantizer, otherwise random bytes whose fp16 super-scale
  fields are overwritten with a small positive scale; docs/FORMAT.md "Quant types"), the tiled pattern fill
  and the per-tensor random streams.
- :mod:`.tokenizer` - :func:`synth_tokenizer`: a small byte-level BPE vocabulary llama.cpp accepts,
  and its ``tokenizer.ggml.*`` keys; :data:`TOKENIZER_CASES`: one vocabulary per pre-tokenizer strata
  accepts and SentencePiece ones, compared with llama.cpp (:func:`write_tokenizer_case`).
- :mod:`.models` - :func:`write_model`: small models of every architecture with a contract
  (``manifests/*.toml``) written with ``gguf.GGUFWriter``, with per-layer expert types, optional fused
  gate/up experts and llama-gguf-split style shards.
- :mod:`.routing` - :class:`TokenRouting` (``ModelSpec.routing``): routers whose choice depends on the token,
  with a stated skew, so hit rates measured on a pattern-filled file mean something; :func:`topic_prompts`:
  prompt sets in topic runs (temporal locality).
- :mod:`.presets` - one small spec per architecture (:func:`qwen3moe_spec`, :func:`llama_spec`,
  :func:`deepseek2_spec`, ... :data:`PRESETS`), each loaded and run by llama.cpp (llama-cpp-python 0.3.36).
- :mod:`.gguf_writer` - :func:`write_header_only`: strata's own minimal GGUF v3 writer, a real header
  and a sparse data section (a hole); it accepts type ids gguf-py does not know (42 = Q2_0).
  :mod:`.reference_model` uses it for the qwen3next reference model, 48 layers and 512 experts
  (:func:`reference_model_header_only`, ~47 GB logical, a few MB of disk).
- :mod:`.shards` - :func:`write_split`: split GGUF files of any size with the tiled pattern, written
  by parallel processes; :func:`write_reference_model` writes the reference model with it (~47 GB).
- :mod:`.broken` - :func:`write_broken`: one malformed file per kind in :data:`BROKEN_KINDS` for the
  GGUF reader's tests.
- :mod:`.upcycle` - :func:`strata.testing.upcycle.write_upcycled_moe`: a real-weight MoE from a real dense Qwen2
  file (each FFN copied into the experts of llama.cpp's ``llama`` MoE form; ``make demo`` runs it).

Shapes are always ggml ``ne`` order (``ne[0]`` = row length, fastest). Sizes are bytes. Type sizes
come from the one registry, :mod:`strata.packer.quants`; GGUF value types from
:mod:`gguf.constants`.
"""

from .blocks import GGUF_QUANTIZABLE, make_random_blocks, pattern_fill, tensor_rng, to_type_id
from .broken import BROKEN_KINDS, write_broken, write_broken_base
from .gguf_writer import KV, DataMode, HeaderLayout, TensorDecl, TensorLayout, write_header_only
from .models import (
    ARCHS,
    DENSE_TYPES,
    MOE_ARCHS,
    ExpertTypes,
    ModelDims,
    ModelSpec,
    PlannedTensor,
    model_kv,
    moe_layers,
    plan_tensors,
    shard_names,
    spec_geometry,
    write_model,
)
from .presets import (
    PRESETS,
    big_dense_spec,
    deepseek2_spec,
    gemma3_spec,
    gpt_oss_spec,
    llama_moe_spec,
    llama_spec,
    qwen2_spec,
    qwen2moe_spec,
    qwen3_spec,
    qwen3moe_spec,
    qwen3next_spec,
    write_big_dense,
    write_tokenizer_case,
)
from .reference_model import (
    REFERENCE_EXPERT_CYCLE,
    reference_model_header_only,
    reference_model_plan,
    write_reference_model,
)
from .routing import PromptSet, TokenRouting, topic_prompts
from .shards import write_split
from .tokenizer import (
    SPECIAL_TOKENS,
    TOKENIZER_CASES,
    SynthTokenizer,
    bytes_to_unicode,
    synth_tokenizer,
    tokenizer_case_kv,
    tokenizer_kv,
)

__all__ = [
    "ARCHS",
    "BROKEN_KINDS",
    "DENSE_TYPES",
    "DataMode",
    "ExpertTypes",
    "GGUF_QUANTIZABLE",
    "HeaderLayout",
    "KV",
    "MOE_ARCHS",
    "ModelDims",
    "ModelSpec",
    "PRESETS",
    "PlannedTensor",
    "REFERENCE_EXPERT_CYCLE",
    "PromptSet",
    "SPECIAL_TOKENS",
    "SynthTokenizer",
    "TOKENIZER_CASES",
    "TensorDecl",
    "TensorLayout",
    "TokenRouting",
    "big_dense_spec",
    "bytes_to_unicode",
    "deepseek2_spec",
    "gemma3_spec",
    "gpt_oss_spec",
    "llama_moe_spec",
    "llama_spec",
    "make_random_blocks",
    "model_kv",
    "moe_layers",
    "pattern_fill",
    "plan_tensors",
    "qwen2_spec",
    "qwen2moe_spec",
    "qwen3_spec",
    "qwen3moe_spec",
    "qwen3next_spec",
    "reference_model_header_only",
    "reference_model_plan",
    "shard_names",
    "spec_geometry",
    "synth_tokenizer",
    "tensor_rng",
    "to_type_id",
    "tokenizer_case_kv",
    "tokenizer_kv",
    "topic_prompts",
    "write_big_dense",
    "write_broken",
    "write_broken_base",
    "write_header_only",
    "write_model",
    "write_reference_model",
    "write_split",
    "write_tokenizer_case",
]
