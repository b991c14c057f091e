"""The synthetic models' presets: one small :class:`~.models.ModelSpec` per architecture strata has a
contract for, each loaded and run by llama.cpp (llama-cpp-python 0.3.36; tests/test_synth.py,
tools/make_budget_reference.py), plus :func:`big_dense_spec` / :func:`write_big_dense` for GB-sized
copy benchmarks.

Every preset takes keyword overrides of :class:`~.models.ModelSpec` fields (``dims`` may be a partial
dict). Metadata keys and tensor shapes come from the architecture's manifest; where an architecture
stores a number under a key whose meaning differs from the synthetic dims' (deepseek2's MLA key_length is
the latent + rope width), the preset says so in ``params``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .models import ModelDims, ModelSpec, plan_tensors, write_model
from .tokenizer import tokenizer_case_kv

__all__ = [
    "PRESETS",
    "big_dense_spec",
    "deepseek2_spec",
    "gemma3_spec",
    "gpt_oss_spec",
    "llama_moe_spec",
    "llama_spec",
    "qwen2_spec",
    "qwen2moe_spec",
    "qwen3_spec",
    "qwen3moe_spec",
    "qwen3next_spec",
    "write_big_dense",
    "write_tokenizer_case",
]


def _spec(defaults: dict[str, Any], overrides: dict[str, Any]) -> ModelSpec:
    dims = dict(defaults.pop("dims", {}))
    if "dims" in overrides:
        o = overrides.pop("dims")
        dims.update(o.model_dump() if isinstance(o, ModelDims) else o)
    return ModelSpec(**{**defaults, **overrides, "dims": ModelDims(**dims)})


def qwen3moe_spec(**overrides: Any) -> ModelSpec:
    """qwen3moe preset: 3 layers, n_embd 256, 8 experts of width 256 (2 used), 4 heads / 2 KV heads of
    64, vocab 512, dense Q8_0. Expert types differ per layer: (Q4_K, Q8_0), (IQ2_XS, IQ4_NL),
    (Q6_K, Q5_0) as (gate/up, down)."""
    return _spec(
        dict(
            arch="qwen3moe",
            name="strata-synth-qwen3moe",
            n_layers=3,
            expert_types=[("Q4_K", "Q8_0"), ("IQ2_XS", "IQ4_NL"), ("Q6_K", "Q5_0")],
        ),
        overrides,
    )


def qwen3next_spec(**overrides: Any) -> ModelSpec:
    """qwen3next preset: 4 layers (0-2 gated delta net, 3 full attention), n_embd 256, 8 experts of
    width 256 (2 used) + a shared expert of 256, 4 heads / 2 KV heads of 64, delta net with 2 k-heads
    and 4 v-heads of 64 (conv 4), vocab 512, dense Q8_0. Experts (gate/up, down): (IQ2_XS, IQ4_NL),
    (IQ2_XXS, Q8_0), (Q4_K, Q5_0), (Q3_K, Q6_K). ``fused_gate_up=True`` writes ffn_gate_up_exps."""
    return _spec(
        dict(
            arch="qwen3next",
            name="strata-synth-qwen3next",
            n_layers=4,
            dims={"rope_dim": 16},
            expert_types=[("IQ2_XS", "IQ4_NL"), ("IQ2_XXS", "Q8_0"), ("Q4_K", "Q5_0"), ("Q3_K", "Q6_K")],
        ),
        overrides,
    )


def qwen2_spec(**overrides: Any) -> ModelSpec:
    """qwen2 (dense) preset: 2 layers, n_embd 256, n_ff 512, 4 heads / 2 KV heads of 64 with q/k/v
    biases, vocab 512, Q8_0 weights except ffn_down Q5_0 and attn_output Q4_0, untied output."""
    return _spec(
        dict(
            arch="qwen2",
            name="strata-synth-qwen2",
            n_layers=2,
            tensor_types={"ffn_down": "Q5_0", "attn_output": "Q4_0"},
        ),
        overrides,
    )


def gemma3_spec(**overrides: Any) -> ModelSpec:
    """gemma3 (small dense) preset: 2 layers (0 sliding window 128, 1 global), n_embd 256, n_ff 512,
    4 heads / 1 KV head of 64, vocab 512, BF16 weights with a Q8_0 token_embd, output tied to token_embd."""
    return _spec(
        dict(
            arch="gemma3",
            name="strata-synth-gemma3",
            n_layers=2,
            dense_type="BF16",
            add_bos=True,
            tensor_types={"token_embd": "Q8_0"},
            tied_output=True,
            dims={"n_head_kv": 1},
        ),
        overrides,
    )


def llama_spec(**overrides: Any) -> ModelSpec:
    """llama (dense, Llama 3 style) preset: 2 layers, n_embd 256, n_ff 512, 4 heads / 2 KV heads of 64
    (GQA), vocab 512, Q8_0 weights except ffn_down Q4_K and attn_output Q5_0, untied output, the Llama 3.1
    ``rope_freqs.weight`` factors; no expert_count key (what Llama and Mistral files carry)."""
    return _spec(
        dict(
            arch="llama",
            name="strata-synth-llama",
            n_layers=2,
            optional_tensors=("rope_freqs.weight",),
            tensor_types={"ffn_down": "Q4_K", "attn_output": "Q5_0"},
            params={"n_expert": None, "n_expert_used": None},
        ),
        overrides,
    )


def llama_moe_spec(**overrides: Any) -> ModelSpec:
    """llama with routed experts (Mixtral style) preset: 2 layers, n_embd 256, 8 experts of
    feed_forward_length 256 (2 used), 4 heads / 2 KV heads of 64, vocab 512, dense Q8_0, router F32.
    Experts (gate/up, down): (Q4_K, Q6_K), (Q8_0, Q5_K)."""
    return _spec(
        dict(
            arch="llama",
            name="strata-synth-mixtral",
            n_layers=2,
            dims={"n_ff": 256},
            expert_types=[("Q4_K", "Q6_K"), ("Q8_0", "Q5_K")],
        ),
        overrides,
    )


def qwen3_spec(**overrides: Any) -> ModelSpec:
    """qwen3 (dense) preset: 2 layers, n_embd 256, n_ff 512, 8 heads / 2 KV heads of 64 (q width 512 !=
    n_embd, as in Qwen3), q/k RMSNorm, vocab 512, Q8_0 weights except ffn_down Q6_K, output tied to
    token_embd (Qwen3 0.6B)."""
    return _spec(
        dict(
            arch="qwen3",
            name="strata-synth-qwen3",
            n_layers=2,
            tied_output=True,
            tensor_types={"ffn_down": "Q6_K"},
            dims={"n_head": 8},
        ),
        overrides,
    )


def qwen2moe_spec(**overrides: Any) -> ModelSpec:
    """qwen2moe preset: 2 layers, n_embd 256, 8 experts of width 256 (2 used) and a shared expert of 512
    with its sigmoid gate row, 4 heads / 2 KV heads of 64 with q/k/v biases, vocab 512, dense Q8_0.
    Experts (gate/up, down): (Q4_K, Q8_0), (Q5_K, Q6_K)."""
    return _spec(
        dict(
            arch="qwen2moe",
            name="strata-synth-qwen2moe",
            n_layers=2,
            dims={"n_ff_shexp": 512},
            optional_tensors=("attn_q.bias", "attn_k.bias", "attn_v.bias"),
            expert_types=[("Q4_K", "Q8_0"), ("Q5_K", "Q6_K")],
        ),
        overrides,
    )


def deepseek2_spec(**overrides: Any) -> ModelSpec:
    """deepseek2 (DeepSeek-V3 style MLA) preset: 3 layers (layer 0 dense FFN of 512, layers 1-2 MoE: 8
    experts of 256, 2 used, sigmoid gating with the exp_probs_b selection bias, weights normalised and
    scaled by 2.5, one shared expert), n_embd 256, 4 heads; MLA with kv_lora_rank 128, q_lora_rank 128,
    qk head 96 (64 nope + 32 rope), v head 64. The keys as conversion/deepseek.py writes them: one KV head
    (head_count_kv 1) of key_length 128 + 32 and value_length 128, key/value_length_mla 96 / 64. Vocab 512,
    dense Q8_0. Experts (gate/up, down): (Q4_K, Q8_0), (Q8_0, Q5_0)."""
    kv_lora, rope, qk, v = 128, 32, 96, 64
    return _spec(
        dict(
            arch="deepseek2",
            name="strata-synth-deepseek2",
            n_layers=3,
            dims={
                "n_ff_exp": 256,
                "n_expert_shared": 1,
                "n_layer_dense_lead": 1,
                "kv_lora_rank": kv_lora,
                "q_lora_rank": 128,
                "rope_dim": rope,
            },
            params={
                "n_head_kv": 1,
                "head_dim": kv_lora + rope,
                "head_dim_v": kv_lora,
                "head_dim_mla": qk,
                "head_dim_v_mla": v,
                "expert_gating_func": 2,
                "expert_weights_norm": True,
                "expert_weights_scale": 2.5,
            },
            optional_tensors=("exp_probs_b.bias",),
            expert_types=[None, ("Q4_K", "Q8_0"), ("Q8_0", "Q5_0")],
        ),
        overrides,
    )


def gpt_oss_spec(**overrides: Any) -> ModelSpec:
    """gpt-oss preset: 3 layers (0 and 2 sliding window 128, 1 full context: the default pattern 2), n_embd
    256, 8 heads / 2 KV heads of 64 with q/k/v/o biases and attention sinks, 8 experts of width 256 (2 used)
    with biases, MXFP4 experts (as published), vocab 512, dense Q8_0, no rope.freq_base_swa key."""
    return _spec(
        dict(
            arch="gpt-oss",
            name="strata-synth-gpt-oss",
            n_layers=3,
            dims={"n_head": 8},
            optional_tensors=("attn_q.bias", "attn_k.bias", "attn_v.bias"),
            params={"rope_base_swa": None},
            expert_types=[("MXFP4", "MXFP4")] * 3,
        ),
        overrides,
    )


#: One preset per architecture with a contract (llama twice: dense and Mixtral style), by name.
PRESETS = {
    "qwen3moe": qwen3moe_spec,
    "qwen3next": qwen3next_spec,
    "qwen2": qwen2_spec,
    "gemma3": gemma3_spec,
    "llama": llama_spec,
    "llama_moe": llama_moe_spec,
    "qwen3": qwen3_spec,
    "qwen2moe": qwen2moe_spec,
    "deepseek2": deepseek2_spec,
    "gpt_oss": gpt_oss_spec,
}


def big_dense_spec(target_bytes: int = 2 << 30, *, seed: int = 0) -> ModelSpec:
    """A qwen2 spec whose tensor data is at least ``target_bytes`` bytes (default 2 GiB), for copy
    benchmarks: n_embd 2048, n_ff 8192, 16 heads / 2 KV heads of 128, vocab 512, Q8_0, and as many
    layers as needed (~63.6 MB each). ``fill="pattern"``: writing 2 GiB takes seconds, not minutes."""
    dims = dict(n_embd=2048, n_ff=8192, n_head=16, n_head_kv=2, head_dim=128)
    base = dict(arch="qwen2", name="strata-synth-big-dense", fill="pattern", seed=seed, dims=dims)
    one = sum(t.nbytes for t in plan_tensors(_spec(dict(base), {"n_layers": 1})))
    two = sum(t.nbytes for t in plan_tensors(_spec(dict(base), {"n_layers": 2})))
    per_layer, fixed = two - one, 2 * one - two
    n_layers = max(1, -(-(int(target_bytes) - fixed) // per_layer))
    return _spec(dict(base), {"n_layers": n_layers})


def write_big_dense(path: str | Path, target_bytes: int = 2 << 30, *, seed: int = 0) -> Path:
    """Write :func:`big_dense_spec` (>= ``target_bytes`` of real, non-sparse tensor data) to ``path``."""
    return write_model(path, big_dense_spec(target_bytes, seed=seed))[0]


def write_tokenizer_case(path: str | Path, name: str) -> Path:
    """A tiny qwen2 model (1 layer) carrying the vocabulary of tokenizer case ``name``
    (:data:`strata.testing.tokenizer.TOKENIZER_CASES`): what llama.cpp loads with ``vocab_only`` and
    ``strata-pack build`` packs. Returns its path."""
    kv, n_vocab = tokenizer_case_kv(name)
    spec = qwen2_spec(
        name=f"strata-synth-tokenizer-{name}",
        n_layers=1,
        dims={"n_vocab": n_vocab, "n_embd": 64, "n_ff": 128, "n_head": 2, "n_head_kv": 1, "head_dim": 32},
    )
    return write_model(path, spec, tokenizer=kv)[0]
