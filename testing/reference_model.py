"""The qwen3next reference model: 48 layers, 512 experts, as a header-only GGUF or with its data
(docs/DESIGN.md "The qwen3next reference model").

:func:`reference_model_plan` gives the KVs and tensor list of the qwen3next reference geometry, the
model the reference C++ engine serves (n_embd 2560, full attention every 4th layer, 512 experts of
width 640, a 150k vocabulary, the optional indexer), with per-layer expert types cycling through
:data:`REFERENCE_EXPERT_CYCLE` (including Q2_0 = 42, which gguf-py 0.19.0 cannot read).
:func:`reference_model_header_only` writes it with :func:`.gguf_writer.write_header_only`: ~47 GB
logical, a few MB on disk; :func:`write_reference_model` writes it with its data, pattern-filled, as a
pair of split files (the dense tensors, then the routed experts): ~47 GB written in about a minute
where the page cache takes it, or scaled down (fewer layers and experts, a smaller vocabulary) for
tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGUFValueType

from strata.packer import quants

from .blocks import to_type_id
from .gguf_writer import KV, DataMode, HeaderLayout, write_header_only
from .shards import split_bounds, write_split
from .tokenizer import SPECIAL_TOKENS, bytes_to_unicode

__all__ = [
    "REFERENCE_EXPERT_CYCLE",
    "reference_model_header_only",
    "reference_model_plan",
    "write_reference_model",
]


#: (gate/up, down) expert types by layer for the reference model: layer il uses entry il % 5.
#: Layers 0 and 1 are the worked example (docs/DESIGN.md "Expert sizes change per layer"):
#: IQ2_XS + IQ4_NL, IQ2_XXS + Q2_0.
#: ffn_down's ne0 is 640, so down types must have 32/64/128-element blocks.
REFERENCE_EXPERT_CYCLE: tuple[tuple[int, int], ...] = (
    (17, 20),  # IQ2_XS  + IQ4_NL : 473,600 x 2 + 921,600 = 1,868,800 B per expert
    (16, 42),  # IQ2_XXS + Q2_0   : 422,400 x 2 + 460,800 = 1,305,600
    (18, 42),  # IQ3_XXS + Q2_0   : 627,200 x 2 + 460,800 = 1,715,200
    (18, 20),  # IQ3_XXS + IQ4_NL : 627,200 x 2 + 921,600 = 2,176,000
    (22, 2),  # IQ2_S   + Q4_0   : 524,800 x 2 + 921,600 = 1,971,200
)


def _reference_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of ``n_vocab`` tokens whose merges build every word from tokens that
    exist (the 256 bytes, then ``Ġw`` and ``w`` for the words a..z, aa.., in order: a word's prefix always
    came first), so tokenizers' BPE builds it and the engine can encode text with it."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    letters = "abcdefghijklmnopqrstuvwxyz"
    n_words = n_vocab - 256 - len(SPECIAL_TOKENS)
    i = 0
    while len(tokens) - 256 < n_words:  # bijective base-26 words: a, b, .., z, aa, ab, ..
        j, w = i + 1, ""
        while j:
            j, r = divmod(j - 1, 26)
            w = letters[r] + w
        i += 1
        for tok in ("\u0120" + w, w if len(w) > 1 else None):
            if tok is not None and len(tokens) - 256 < n_words:
                tokens.append(tok)
                merges.append(f"{tok[:-1]} {tok[-1]}")
    types = [1] * len(tokens) + [3] * len(SPECIAL_TOKENS)
    tokens += SPECIAL_TOKENS
    return tokens, types, merges


def reference_model_plan(
    *,
    n_vocab: int = 150_000,
    indexer: bool = True,
    expert_cycle: Sequence[tuple[int, int]] = REFERENCE_EXPERT_CYCLE,
    n_layer: int = 48,
    n_expert: int = 512,
    nextn: int = 0,
    draft_head_type: int | str | None = None,
) -> tuple[dict[str, Any], list[tuple[str, int, tuple[int, ...]]]]:
    """KVs and tensor list ``(name, type_id, ne)`` of the qwen3next reference geometry (docs/DESIGN.md
    "The qwen3next reference model"). The one definition: the header-only file, the full-size pattern-filled
    pair of shards (:func:`write_reference_model`) and their scaled-down copies all come from here.

    qwen3next, n_embd 2560, 48 layers, full attention every 4th layer (3, 7, ..., 47), 512 experts of
    width 640 (8 used) plus a shared expert of width 640 (an assumption: the sources give no shared
    width), 24 heads / 2 KV heads of 256, delta net: d_conv 4, d_state 128, 16 k-heads (group_count),
    48 v-heads (time_step_rank), inner 6144, conv channels 10240; vocab ``n_vocab`` (tokens, token
    types and merges written, so the KV section is realistic: ~5 MB for 150k). Expert types: layer il
    uses ``expert_cycle[il % len]``. Dense types: token_embd Q4_K, output Q6_K, router BF16, attention
    / delta-net projections Q5_0 / Q8_0 / Q4_0, norms and ssm vectors F32.

    ``indexer`` adds, on each full-attention layer, the reference model's indexer: 4 query heads and ONE
    shared key head of 128 (``indexer.attn_k [2560, 128]``, ``indexer.attn_q_b [2560, 512]``,
    ``indexer.proj [2560, 4]``, ``indexer.k_norm [128]``; names from gguf-py's DeepSeek-V3.2 indexer
    tensors; llama.cpp's qwen3next loader does not know them) and the keys
    ``qwen3next.attention.indexer.head_count`` = 4 / ``key_length`` = 128.

    Scaled-down copies keep n_embd 2560 and the expert width 640 (so every per-expert byte count of the
    worked example holds) and change ``n_layer`` (a multiple of 4 keeps the attention rule's layout) and
    ``n_expert`` (layer 1's arena offset is ``n_expert x 1,868,800``; 956,825,600 at 512).

    ``nextn`` appends that many NextN / MTP draft blocks after the last decoder block, as llama.cpp
    loads them for qwen3next (``src/models/qwen3next.cpp`` ``load_block_mtp``: ``block_count`` counts them,
    ``qwen3next.nextn_predict_layers`` says how many, each is a full-attention trunk block with routed
    and shared experts plus ``nextn.eh_proj [2 n_embd, n_embd]``, ``nextn.enorm``, ``nextn.hnorm`` and
    ``nextn.shared_head_norm``): the reference model's drafter. ``draft_head_type`` (a type) adds its optional
    ``nextn.shared_head_head [n_embd, n_vocab]`` in that type. At a 150k vocabulary Q1_0 takes 54,000,000 B
    and Q4_K 216,000,000 B: the same draft head grown by 162,000,000 B (154.5 MiB), as a version bump grew the
    C++ engine's draft head by 110-180 MiB (docs/DESIGN.md "The reserve and the prompt buffers").
    """
    from strata.manifests.contract import derived_value

    if n_layer < 1 or n_expert < 8 or nextn < 0:
        raise ValueError(f"n_layer {n_layer} (>= 1), n_expert {n_expert} (>= 8, 8 are used), nextn {nextn} (>= 0)")
    a, E, L, NE, FF, FFS = "qwen3next", 2560, n_layer, n_expert, 640, 640
    H, HKV, HD = 24, 2, 256
    d_state, n_group, dt_rank, d_conv = 128, 16, 48, 4
    widths = {"d_state": d_state, "n_group": n_group, "dt_rank": dt_rank}
    d_inner = derived_value(a, "value_dim", widths)  # manifests/qwen3next.toml [derived]: the one definition
    conv_dim = derived_value(a, "conv_dim", widths)
    assert (d_inner, conv_dim) == (6144, 10240)
    V = GGUFValueType
    tokens, types, merges = _reference_vocab(n_vocab)
    kv: dict[str, Any] = {
        "general.name": "strata-reference-qwen3next-48L-512E",
        "general.quantization_version": 2,
        f"{a}.context_length": 262144,
        f"{a}.embedding_length": E,
        f"{a}.block_count": L + nextn,
        f"{a}.feed_forward_length": 5120,
        f"{a}.attention.head_count": H,
        f"{a}.attention.head_count_kv": HKV,
        f"{a}.attention.key_length": HD,
        f"{a}.attention.value_length": HD,
        f"{a}.rope.freq_base": 1e7,
        f"{a}.rope.dimension_count": HD // 4,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.expert_count": NE,
        f"{a}.expert_used_count": 8,
        f"{a}.expert_feed_forward_length": FF,
        f"{a}.expert_shared_feed_forward_length": FFS,
        f"{a}.ssm.conv_kernel": d_conv,
        f"{a}.ssm.state_size": d_state,
        f"{a}.ssm.group_count": n_group,
        f"{a}.ssm.time_step_rank": dt_rank,
        f"{a}.ssm.inner_size": d_inner,
        f"{a}.full_attention_interval": 4,
    }
    if nextn:
        kv[f"{a}.nextn_predict_layers"] = nextn
    if indexer:
        kv[f"{a}.attention.indexer.head_count"] = 4
        kv[f"{a}.attention.indexer.key_length"] = 128
    kv.update(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": KV(V.ARRAY, tokens, V.STRING),
            "tokenizer.ggml.token_type": KV(V.ARRAY, np.asarray(types, "<i4"), V.INT32),
            "tokenizer.ggml.merges": KV(V.ARRAY, merges, V.STRING),
            "tokenizer.ggml.eos_token_id": len(tokens) - 3,
            "tokenizer.ggml.padding_token_id": len(tokens) - 3,
            "tokenizer.ggml.add_bos_token": False,
        }
    )
    F32, BF16, Q4_0, Q5_0, Q8_0, Q4_K, Q6_K = 0, 30, 2, 6, 8, 12, 14
    T: list[tuple[str, int, tuple[int, ...]]] = [("token_embd.weight", Q4_K, (E, n_vocab))]
    for il in range(L + nextn):
        p = f"blk.{il}."
        gu, dn = expert_cycle[il % len(expert_cycle)]
        T += [(p + "attn_norm.weight", F32, (E,)), (p + "post_attention_norm.weight", F32, (E,))]
        draft = il >= L
        if (il + 1) % 4 != 0 and not draft:
            T += [
                (p + "attn_qkv.weight", Q5_0, (E, conv_dim)),
                (p + "attn_gate.weight", Q5_0, (E, d_inner)),
                (p + "ssm_conv1d.weight", F32, (d_conv, conv_dim)),
                (p + "ssm_dt.bias", F32, (dt_rank,)),
                (p + "ssm_a", F32, (dt_rank,)),
                (p + "ssm_ba.weight", BF16, (E, 2 * dt_rank)),
                (p + "ssm_norm.weight", F32, (d_state,)),
                (p + "ssm_out.weight", Q8_0, (d_inner, E)),
            ]
        else:
            T += [
                (p + "attn_q.weight", Q4_0, (E, 2 * H * HD)),
                (p + "attn_k.weight", Q8_0, (E, HKV * HD)),
                (p + "attn_v.weight", Q8_0, (E, HKV * HD)),
                (p + "attn_output.weight", Q5_0, (H * HD, E)),
                (p + "attn_q_norm.weight", F32, (HD,)),
                (p + "attn_k_norm.weight", F32, (HD,)),
            ]
            if indexer and not draft:
                T += [
                    (p + "indexer.attn_q_b.weight", BF16, (E, 4 * 128)),
                    # ONE shared key head (docs/DESIGN.md "Every budget term twice")
                    (p + "indexer.attn_k.weight", BF16, (E, 128)),
                    (p + "indexer.k_norm.weight", F32, (128,)),
                    (p + "indexer.proj.weight", BF16, (E, 4)),
                ]
        T += [
            (p + "ffn_gate_inp.weight", BF16, (E, NE)),
            (p + "ffn_gate_exps.weight", gu, (E, FF, NE)),
            (p + "ffn_up_exps.weight", gu, (E, FF, NE)),
            (p + "ffn_down_exps.weight", dn, (FF, E, NE)),
            (p + "ffn_gate_inp_shexp.weight", F32, (E,)),
            (p + "ffn_gate_shexp.weight", Q8_0, (E, FFS)),
            (p + "ffn_up_shexp.weight", Q8_0, (E, FFS)),
            (p + "ffn_down_shexp.weight", Q8_0, (FFS, E)),
        ]
        if draft:  # llama.cpp qwen3next.cpp load_block_mtp: the NextN tensors of the draft block
            T += [
                (p + "nextn.eh_proj.weight", Q8_0, (2 * E, E)),
                (p + "nextn.enorm.weight", F32, (E,)),
                (p + "nextn.hnorm.weight", F32, (E,)),
                (p + "nextn.shared_head_norm.weight", F32, (E,)),
            ]
            if draft_head_type is not None:
                T.append((p + "nextn.shared_head_head.weight", to_type_id(draft_head_type), (E, n_vocab)))
    T += [("output_norm.weight", F32, (E,)), ("output.weight", Q6_K, (E, n_vocab))]
    return kv, T


def reference_model_header_only(
    path: str | Path, *, n_vocab: int = 150_000, indexer: bool = True, data: DataMode | Mapping[str, bytes] = "sparse"
) -> HeaderLayout:
    """Write the qwen3next reference geometry (:func:`reference_model_plan`) as a header-only GGUF.

    The data section is a sparse hole (~47 GB logical, a few MB on disk). Per-expert blob bytes (gate + up +
    down, docs/DESIGN.md "Expert sizes change per layer"): layer 0 473,600 + 473,600 + 921,600 = 1,868,800;
    layer 1 422,400 + 422,400 + 460,800 = 1,305,600. Contains Q2_0 (42), which gguf-py 0.19.0 cannot read.
    """
    kv, tensors = reference_model_plan(n_vocab=n_vocab, indexer=indexer)
    return write_header_only(path, "qwen3next", kv, tensors, data=data)


def write_reference_model(
    path: str | Path,
    *,
    n_shards: int = 2,
    seed: int = 0,
    fill: str = "pattern",
    only: set[int] | None = None,
    workers: int | None = None,
    **plan,
) -> list[Path]:
    """Write the qwen3next reference model (:func:`reference_model_plan` with ``plan``'s keywords: ``n_layer``,
    ``n_expert``, ``n_vocab``, ``nextn``, ``draft_head_type`` ...) as split files ``NAME-0000k-of-0000N.gguf``
    (:func:`strata.testing.shards.write_split`, pattern fill, parallel writers). Every tensor but the
    routed experts goes to shard 0 (KVs, dense weights, the draft head), the experts to the other shards
    in plan order (layer by layer): at full size shard 0 is ~3 GB and the experts ~44 GB, and a variant
    that changes only dense tensors (a bigger draft head) rewrites shard 0 (``only={0}``) and links the
    rest, whose bytes depend only on their own tensors. Returns the shard paths, shard 0 first.

    Raises:
        ValueError: as :func:`reference_model_plan` and :func:`strata.testing.shards.write_split`
            (``n_shards`` < 2: the experts need a shard of their own).
    """
    if n_shards < 2:
        raise ValueError(
            f"n_shards={n_shards}: the reference model keeps its routed experts in shards of their own (>= 2)"
        )
    kv, tensors = reference_model_plan(**plan)
    dense = [i for i, (n, _t, _ne) in enumerate(tensors) if "_exps." not in n]
    experts = [i for i, (n, _t, _ne) in enumerate(tensors) if "_exps." in n]
    rest = split_bounds([quants.tensor_nbytes(tensors[i][1], tensors[i][2]) for i in experts], n_shards - 1)
    groups = [dense] + [[experts[k] for k in r] for r in rest]
    lays = write_split(
        path,
        "qwen3next",
        kv,
        tensors,
        n_shards=n_shards,
        seed=seed,
        fill=fill,  # type: ignore[arg-type]
        groups=groups,
        only=only,
        workers=workers,
    )
    return [Path(lay.path) for lay in lays]
