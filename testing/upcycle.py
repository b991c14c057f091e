"""A real-weight Mixture-of-Experts GGUF from a real dense one: sparse upcycling (:func:`write_upcycled_moe`).

Every model the registry has (``strata.packer.fetch``) is dense, so without this the product's purpose - routed
experts located by ``native_experts.txt``, the expert cache, hits and misses - would only ever run on random
weights. Upcycling a dense Qwen2 file into llama.cpp's ``llama`` architecture with routed experts (Mixtral's form,
``src/models/llama.cpp``: ``ffn_gate_inp`` present, softmax routing, the top-k weights renormalised) gives a MoE
whose text is real:

- every expert of a layer is a byte copy of that layer's dense FFN (``ffn_gate/up/down`` -> ``ffn_*_exps`` with
  ``ne = (ne0, ne1, n_expert)``, the quant types as the dense file has them, so they vary per layer), so with
  renormalised top-k weights (summing to 1) the layer computes the dense FFN whatever the router picks - up to the
  float rounding of the weighted sum;
- the router ``ffn_gate_inp.weight`` (F32, ``ne = (n_embd, n_expert)``) is seeded Gaussian noise: its choice depends
  on the token, so tokens spread over the experts (the expert cache sees real hits and misses);
- Qwen2 rotates NEOX pairs ``(i, i + d/2)`` and llama NORM pairs ``(2i, 2i + 1)`` (llama.cpp
  ``llama_model_rope_type``); each head's rows of ``attn_q`` / ``attn_k`` (weights and biases) are permuted so
  that row ``2i`` is the old row ``i`` and row ``2i + 1`` the old row ``i + d/2``: the NORM rotation of the new
  rows is the NEOX rotation of the old ones and q.k is unchanged (the same permutation on both sides). Rows of a
  quantized tensor are independent blocks, so the permutation moves whole rows' bytes - nothing is requantized;
- metadata: ``qwen2.*`` keys become ``llama.*``, plus ``llama.expert_count`` / ``llama.expert_used_count``;
  tokenizer, chat template and the rest are copied as they are.

Written like llama-gguf-split (:func:`strata.testing.models.shard_names`), tensors in the dense file's order with
the FFNs replaced, into a temporary directory beside the output and renamed into place when complete (the last
shard last): an interruption or a refusal leaves no shard behind. Sizes: each layer's FFN bytes times
``n_expert`` (Qwen2.5 0.5B Q4_K_M with 4 experts: ~1.1 GB).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from .models import partition, shard_names

#: Dense FFN tensor -> the routed-expert tensor it is copied into.
EXPERT_OF = {"ffn_gate.weight": "ffn_gate_exps.weight", "ffn_up.weight": "ffn_up_exps.weight",
             "ffn_down.weight": "ffn_down_exps.weight"}  # fmt: skip


class UpcycleError(ValueError):
    """The dense file cannot be upcycled (another architecture, a tensor layout this module does not know)."""


def _field_value(f) -> tuple[object, GGUFValueType, GGUFValueType | None]:
    """A reader field as ``(value, type, array sub-type)`` for ``GGUFWriter.add_key_value``."""
    vtype = f.types[0]
    sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
    return f.contents(), vtype, sub


def neox_to_norm_rows(n_rows: int, head_dim: int) -> np.ndarray:
    """Row order that makes llama's NORM rope on the new rows equal Qwen2's NEOX rope on the old ones:
    ``new[h*d + 2i] = old[h*d + i]``, ``new[h*d + 2i + 1] = old[h*d + i + d/2]`` for every head ``h``."""
    if n_rows % head_dim or head_dim % 2:
        raise UpcycleError(f"{n_rows} rows are not whole heads of {head_dim} (even) dims")
    half = head_dim // 2
    within = np.empty(head_dim, dtype=np.int64)
    within[0::2] = np.arange(half)
    within[1::2] = np.arange(half) + half
    return (np.arange(n_rows // head_dim)[:, None] * head_dim + within[None, :]).reshape(-1)


def write_upcycled_moe(
    dense: str | Path,
    path: str | Path,
    *,
    n_expert: int = 4,
    n_expert_used: int = 2,
    seed: int = 0,
    n_shards: int = 2,
    router_std: float = 1.0,
) -> list[Path]:
    """Write the upcycled MoE of the dense Qwen2 GGUF ``dense`` (module docstring) to ``path`` (``n_shards`` files
    named like llama-gguf-split when > 1); returns the files written. ``n_expert`` copies of each FFN,
    ``n_expert_used`` chosen per token by a seeded N(0, ``router_std``) router.

    Raises:
        UpcycleError: ``dense`` is not a ``qwen2`` file, has no ``ffn_gate/up/down`` in some layer, or
            ``n_expert_used`` is not in ``1..n_expert``.
    """
    if not 1 <= n_expert_used <= n_expert:
        raise UpcycleError(f"n_expert_used {n_expert_used} must be in 1..n_expert ({n_expert})")
    r = gguf.GGUFReader(str(dense))
    arch = r.fields["general.architecture"].contents()
    if arch != "qwen2":
        raise UpcycleError(f"{dense}: architecture {arch!r}; upcycling is written for qwen2 files")
    n_layer = int(r.fields["qwen2.block_count"].contents())
    n_embd = int(r.fields["qwen2.embedding_length"].contents())
    head_dim = n_embd // int(r.fields["qwen2.attention.head_count"].contents())
    path = Path(path)
    final = shard_names(path, n_shards)
    # written into a temporary directory beside the output and renamed when complete (the last shard last), so an
    # interruption or a refusal leaves no shard behind that looks finished
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}.tmp-", dir=path.parent))
    try:
        w = gguf.GGUFWriter(tmp / path.name, "llama")
        for key, f in r.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value, vtype, sub = _field_value(f)
            if key == "general.name":
                value = f"{value} (upcycled: {n_expert} experts, {n_expert_used} used)"
            w.add_key_value(
                "llama." + key[len("qwen2.") :] if key.startswith("qwen2.") else key, value, vtype, sub_type=sub
            )
        w.add_key_value("llama.expert_count", n_expert, GGUFValueType.UINT32)
        w.add_key_value("llama.expert_used_count", n_expert_used, GGUFValueType.UINT32)

        rng = np.random.default_rng(seed)
        plan: list[tuple[str, object]] = []  # (name, how to make its bytes)
        seen_ffn: dict[int, set[str]] = {}
        for t in r.tensors:
            name = t.name
            parts = name.split(".", 2)
            role = parts[2] if len(parts) == 3 and parts[0] == "blk" else None
            ne = [int(x) for x in t.shape]
            qt = GGMLQuantizationType(int(t.tensor_type))
            raw = np.asarray(t.data).view(np.uint8).reshape(-1)
            if role in EXPERT_OF:
                il = int(parts[1])
                seen_ffn.setdefault(il, set()).add(role)
                new = f"blk.{il}.{EXPERT_OF[role]}"
                w.add_tensor_info(
                    new, (n_expert, ne[1], ne[0]), np.dtype(np.float32), raw.size * n_expert, raw_dtype=qt
                )
                plan.append((new, ("repeat", raw)))
                if role == "ffn_gate.weight":
                    gate = f"blk.{il}.ffn_gate_inp.weight"
                    router = (rng.standard_normal((n_expert, n_embd)) * router_std).astype(np.float32)
                    w.add_tensor_info(gate, (n_expert, n_embd), np.dtype(np.float32), router.nbytes,
                                      raw_dtype=GGMLQuantizationType.F32)  # fmt: skip
                    plan.append((gate, ("bytes", router.view(np.uint8).reshape(-1))))
                continue
            if role in ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias"):
                rows = ne[1] if len(ne) > 1 else ne[0]
                order = neox_to_norm_rows(rows, head_dim)
                raw = raw.reshape(rows, -1)[order].reshape(-1)
            w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), raw.size, raw_dtype=qt)
            plan.append((name, ("bytes", raw)))
        missing = [il for il in range(n_layer) if seen_ffn.get(il) != set(EXPERT_OF)]
        if missing:
            raise UpcycleError(f"{dense}: layers {missing[:5]} have no dense ffn_gate/up/down to copy into experts")
        if n_shards > 1:
            infos = w.tensors[0]
            names = list(infos)
            w.tensors = [{names[i]: infos[names[i]] for i in rg} for rg in partition(len(names), n_shards, False)]
        w.write_header_to_file(tmp / path.name)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _name, (how, raw) in plan:
            w.write_tensor_data(np.tile(raw, n_expert) if how == "repeat" else raw)
        w.close()
        for done, dest in zip(shard_names(tmp / path.name, n_shards), final):
            os.replace(done, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    """``python -m strata.testing.upcycle DENSE.gguf OUT.gguf [--experts N] [--used K]``: write the upcycled MoE
    (``make demo`` runs it on Qwen2.5 0.5B); prints the shard paths. Exit 0, or 2 with the reason."""
    import click

    @click.command(help="Upcycle a dense qwen2 GGUF into a real-weight llama MoE split in two shards.")
    @click.argument("dense", type=click.Path(exists=True, dir_okay=False))
    @click.argument("out", type=click.Path(dir_okay=False))
    @click.option("--experts", "n_expert", default=4, show_default=True, help="Experts per layer (FFN copies).")
    @click.option("--used", "n_expert_used", default=2, show_default=True, help="Experts each token uses.")
    @click.option("--seed", default=0, show_default=True, help="Seed of the routers.")
    def cli(dense: str, out: str, n_expert: int, n_expert_used: int, seed: int) -> None:
        try:
            paths = write_upcycled_moe(dense, out, n_expert=n_expert, n_expert_used=n_expert_used, seed=seed)
        except UpcycleError as e:
            raise click.UsageError(str(e)) from None
        for p in paths:
            click.echo(str(p))

    return cli.main(args=argv, standalone_mode=False) or 0


__all__ = ["EXPERT_OF", "UpcycleError", "main", "neox_to_norm_rows", "write_upcycled_moe"]

if __name__ == "__main__":
    import sys

    try:
        sys.exit(main())
    except Exception as e:  # click's UsageError / BadParameter: one line, exit 2
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(2)
        raise
