"""Whether a ``--kv`` cache type can store a model's K/V rows (:func:`kv_type_error`): the plan refuses a type
that cannot (:func:`strata.budget.plan.make_plan`) and never suggests one.
"""

from __future__ import annotations

from strata.layout import kv as LK
from strata.packer import quants

from .errors import PlanInputError
from .plan_model import ModelFacts
from .profile import layer_span


def _kv_tensor(facts: ModelFacts, il: int, part: str) -> str:
    """The projection whose rows one layer's K / V / indexer-K cache row comes from."""
    names = {t.name for t in facts.dense}
    own = {
        "K": f"blk.{il}.attn_k.weight",
        "V": f"blk.{il}.attn_v.weight",
        "indexer K": f"blk.{il}.indexer.attn_k.weight",
    }[part]
    fused = f"blk.{il}.attn_qkv.weight"
    return own if own in names or fused not in names else fused


def kv_type_error(facts: ModelFacts, kv: str) -> PlanInputError | None:
    """Why the ``kv`` cache type cannot store this model's K/V rows (None: it can).

    A block-quantized cache (``int8`` = ggml Q8_0, 32 values per block) stores every head's row in
    whole blocks: llama.cpp refuses a quantized K (V) cache unless the block size divides
    n_embd_head_k (n_embd_head_v) (llama-context.cpp), and :func:`strata.layout.kv.kv_row_bytes` needs the
    per-token row (n_head_kv x head dim) to be whole blocks. The error names the first layer's
    projection tensor, the dimension and the numbers, and how many layers are affected.
    """
    t = quants.qtype(LK.KV_CACHE_TYPES[kv])
    B = t.block_elems
    if B == 1:
        return None
    heads = {
        "K": (facts.head_dim, "key_length"),
        "V": (facts.head_dim_v or facts.head_dim, "value_length"),
        "indexer K": (0, "indexer key_length"),
    }
    bad: list[tuple[int, str, int, int]] = []  # layer, part, row elements, head elements (0: unknown)
    for L in facts.kv_layers:
        for part, n in (("K", L.k), ("V", L.v), ("indexer K", L.indexer_k)):
            head = heads[part][0]
            if n and (n % B or (head and head % B)):
                bad.append((L.layer, part, n, head))
    if not bad:
        return None
    il, part, n, head = bad[0]
    tensor = _kv_tensor(facts, il, part)
    layers = [b[0] for b in bad]
    if head and head % B:
        what = f"a head dim ({heads[part][1]}) of {head} elements"
        size = head
        found = f"{part} head of {head} elements ({n} per token in layer {il})"
    else:
        dim = f"n_head_kv x {heads[part][1]}" if part != "indexer K" else heads[part][1]
        what = f"a row ({dim}) of {n} elements per token"
        size = n
        found = f"{part} row of {n} elements per token"
    return PlanInputError(
        f"--kv {kv}: the {part} cache of layer {il} ({tensor}) has {what}, not a multiple of the "
        f"{t.name} block of {B} ({size} = {size // B} x {B} + {size % B}); {len(set(layers))} attention layer(s) "
        f"affected ({layer_span(layers)}); use --kv f16 or --kv f32",
        tensor=tensor,
        found=found,
        required=f"a multiple of {B} elements ({t.name} block) for --kv {kv}",
    )
