"""strata's GPU decode step (bytes): the fused step's device buffers and logit summary, the q8
kernels' quantized-activation layout, the gated-delta-net buffers, and an estimate of the generic
per-layer path's temporaries. The engine allocates with these functions (``strata.engine.gpu.fused``,
``fused_moe``, ``fused_gdn``) and the budget's "prefill/activations" term is them (``budget/engine_terms.py``).
"""

from __future__ import annotations

from .buffers import F32_BYTES

#: Bytes at the start of the fused step's staging buffer holding its integers (``pos`` at 0):
#: ``strata.engine.gpu.fused.FusedDecoder``'s staging row.
FUSED_PARAM_BYTES = 16

#: The fused step's logit summary (engine/gpu/cuda/logit_top.cu, read by the greedy decode instead of the whole
#: row): the best LOGIT_TOP_K (id, logit) pairs, ranked by LOGIT_TOP_PARTS CTAs then merged, into
#: LOGIT_TOP_WORDS int32 words (the non-finite count, the ids at 1.., the logits' bits at 8..).
LOGIT_TOP_K, LOGIT_TOP_PARTS, LOGIT_TOP_WORDS = 5, 64, 16
#: Device bytes of that summary: per part LOGIT_TOP_K logits, LOGIT_TOP_K ids and a count (4 bytes each), and
#: the LOGIT_TOP_WORDS words of the result.
FUSED_TOP_BYTES = 4 * (LOGIT_TOP_PARTS * (2 * LOGIT_TOP_K + 1) + LOGIT_TOP_WORDS)


#: The fused step's expert prefetch (``strata.engine.gpu.prefetch``): staging slots a MoE layer (its predicted
#: host-tier experts copied ahead, the most probable first) and sets of them (layer ``j`` writes set
#: ``j % PREFETCH_SETS``). One set: layer ``j``'s copy is forked after the ``resid_norm`` that follows layer ``j - 1``'s
#: experts, the set's last readers, so no copy ever runs beside a reader (a second set was 2 slots of VRAM for
#: nothing: session 18's review).
PREFETCH_SLOTS, PREFETCH_SETS = 2, 1
#: Most bytes the staging slots may take: past it the model gets none and no prefetch (a 64 MiB copy at PCIe 5.0's
#: ~50 GB/s takes 1.3 ms, far longer than the layer it would hide behind: Mixtral-8x7B's 114 MB experts would have
#: taken 218 MiB of VRAM for nothing - session 18's new-user run).
PREFETCH_MAX_BYTES = 64 << 20


def prefetch_entries(slot_bytes: int) -> int:
    """Staging slots of the fused step's expert prefetch for experts of ``slot_bytes`` (one expert-cache slot):
    :data:`PREFETCH_SETS` x :data:`PREFETCH_SLOTS` where they take at most :data:`PREFETCH_MAX_BYTES`, else 0 (no
    prefetch). The engine and the budget both ask here."""
    n = PREFETCH_SETS * PREFETCH_SLOTS
    return n if 0 < n * int(slot_bytes) <= PREFETCH_MAX_BYTES else 0


def prefetch_bytes(n_embd: int, n_expert: int, slot_bytes: int, n_layer: int) -> int:
    """Device bytes of the fused step's expert prefetch (``strata.engine.gpu.prefetch.Prefetch.nbytes``): the next
    layer's router input (``n_embd`` f32) and predicted logits (``n_expert`` f32), per staging entry
    (:func:`prefetch_entries`) a tag (int32) and a source address (u64), two counters a layer (int32: experts staged
    and read in the step) and the staging slots themselves (one expert-cache slot, ``slot_bytes``, each: the largest
    engine-form blob)."""
    S = prefetch_entries(slot_bytes)
    return 4 * (n_embd + n_expert) + S * (4 + 8) + 8 * int(n_layer) + S * int(slot_bytes)


def q8_act_bytes(n: int) -> int:
    """Bytes of one quantized activation vector of ``n`` values (``n`` a multiple of 32) as strata's q8 kernels lay
    it out on both devices (engine/kernel_src/q8_layout.h ``act_nbytes_of``): int8 values, f32 block scales (one per 32
    slots), int16 sums per 16 and per 32 values, each plane padded to 64 bytes. The C function and this one are
    compared in tests/test_engine_cpu_q8.py."""

    def pad(b: int) -> int:
        return (b + 63) // 64 * 64

    return pad(n) + pad(n // 32 * 4) + pad(n // 16 * 2) + pad(n // 32 * 2)


def gdn_step_bytes(conv_dim: int, value_dim: int, conv_weight_elements: int) -> int:
    """The fused step's gated-delta-net buffers (bytes; ``strata.engine.gpu.fused_gdn.GdnBuffers``): the
    conv output (``conv_dim``) and the gated-normed output (``value_dim``), shared by the layers, and
    every recurrent layer's ``ssm_conv1d`` weights as f32 (``conv_weight_elements`` = their sum of
    ``d_conv x conv_dim``): f32 each. 0 for a model without delta-net layers."""
    if not conv_weight_elements:
        return 0
    return F32_BYTES * (conv_dim + value_dim + conv_weight_elements)


def fused_step_bytes(
    n_embd: int,
    n_head: int,
    head_dim: int,
    head_dim_v: int,
    n_ff_max: int,
    kv_positions_max: int,
    *,
    n_layer: int = 0,
    n_expert: int = 0,
    n_expert_used: int = 0,
    n_ff_exp: int = 0,
    value_dim: int = 0,
    slot_bytes: int = 0,
) -> int:
    """Device buffers of strata's fused GPU decode step (bytes; ``strata.engine.gpu.fused.FusedDecoder.nbytes``,
    allocated at the "prompt path" checkpoint, before the expert cache): the residual and normed rows
    (``2 n_embd``), the query and attention outputs (``n_head x head_dim``, ``n_head x head_dim_v``), the
    gated activation of the widest dense FFN or shared expert (``n_ff_max``, 1 without one), the attention
    scores (``n_head x`` the longest KV cache of any layer) - f32 each - the staging row
    (:data:`FUSED_PARAM_BYTES` + ``4 n_embd``), the logit summary (:data:`FUSED_TOP_BYTES`) and the q8 kernels'
    quantized input (:func:`q8_act_bytes` of the longest matvec input: ``n_embd``, ``n_head x head_dim_v``,
    ``n_ff_max`` or a delta-net layer's ``value_dim``, and the normed row's, written by its ``resid_norm``:
    ``n_embd``; allocated whatever the kernel, so the term does not depend on ``--kernel``). With routed
    experts (``n_expert`` > 0) the MoE step's (``strata.engine.gpu.fused_moe.MoeStep.nbytes``): router
    probabilities (``n_expert``), the selected weights (``n_expert_used``), gate, up and activation of the selected
    experts (``3 x n_expert_used x n_ff_exp``), their outputs (``n_expert_used x n_embd``; their weighted sum is made
    inside the next ``resid_norm``: no row of its own), the shared gate (1) and the slot table (``n_layer x n_expert``)
    in f32 / int32, the three part addresses per selected expert (u64), the routing record (every layer's ids and slots:
    ``n_layer x 2 x n_expert_used`` int32), the split's keep table (``n_expert_used + 1`` int32:
    ``strata.engine.gpu.miss_split.keep_table``), the cache's and the host tier's addresses (u64 each) and the selected
    experts' quantized down-projection inputs (``n_expert_used x q8_act_bytes(n_ff_exp)``), and the expert prefetch's
    buffers (:func:`prefetch_bytes`, ``slot_bytes``: one expert-cache slot). The one definition of the
    budget's "prefill/activations" term on the fused path; tests check it against the engine's."""
    dense = (
        F32_BYTES
        * (2 * n_embd + n_head * head_dim + n_head * head_dim_v + max(n_ff_max, 1) + n_head * kv_positions_max)
        + FUSED_PARAM_BYTES
        + F32_BYTES * n_embd
        + FUSED_TOP_BYTES
        + q8_act_bytes(max(n_embd, n_head * head_dim_v, max(n_ff_max, 1), value_dim))
        + q8_act_bytes(n_embd)
    )
    if not n_expert:
        return dense
    E, K, n = n_expert, n_expert_used, n_embd
    return (
        dense
        + 4 * (E + K + 3 * K * n_ff_exp + K * n + 1 + n_layer * E + K + 1)
        + 8 * 3 * K
        + 4 * 2 * K * n_layer
        + 8
        + 8
        + K * q8_act_bytes(n_ff_exp)
        + prefetch_bytes(n, E, slot_bytes, n_layer)
    )


def generic_step_bytes(
    act_per_token: int,
    logits_per_token: int,
    kv_positions_max: int,
    kv_elements_max: int,
    n_head: int,
    ssm_elements_max: int,
) -> int:
    """An estimate (bytes) of what the generic per-layer GPU path's warm-up leaves cached in CuPy's pool:
    the largest temporaries of one step at the last position - f32 copies of one layer's K and V for every
    position it holds (``kv_positions_max x kv_elements_max``, K and V elements per token), the attention
    scores and probabilities (``2 x n_head x kv_positions_max``), three delta-net state-sized temporaries
    (decay, outer product, readout: ``3 x ssm_elements_max``), one position's activations and the
    logits. Not exact: the pool keeps freed blocks by size; ``strata-engine measure`` reports it beside the
    measured growth."""
    return F32_BYTES * (
        act_per_token
        + logits_per_token
        + kv_positions_max * kv_elements_max
        + 2 * n_head * kv_positions_max
        + 3 * ssm_elements_max
    )
