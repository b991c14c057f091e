"""Engine start-up: one checkpoint sequence for every device.

:func:`load_engine` runs the stages below in this order, each timed and measured
(:mod:`strata.engine.checkpoints`, printed by ``--verbose``). What a stage does on a device is the
device's (:class:`Device`: :class:`strata.engine.cpu.device.CpuDevice`, ``strata.engine.gpu.device.GpuDevice``
for ``cuda`` and its NumPy simulation ``sim``); the order is written once, here:

1. ``pack``: the strict readers (:func:`strata.packer.pack.open_pack`), the geometry from
   geometry.txt, and every load-time assertion (:func:`strata.engine.loader.check_pack`) - all
   before a weight byte is read;
2. ``weights``: the dense layer weights;
3. ``head``: the output head - before the expert cache, so that a cache sized from what is free
   cannot eat the head's memory (docs/DESIGN.md "The head before the cache");
4. ``session``: KV cache (``kv`` f16 | f32; sliding-window layers as ring buffers of the budget's
   size; a sparse-attention indexer's key store), rope tables, the tokenizer, the per-token buffers;
5. ``drafter`` (a pack with NextN draft blocks): the draft head's weights in engine form - the
   reference C++ engine's checkpoint "the weights, the session and the drafter";
6. ``prompt path``: everything the token loop will run is loaded now (kernels, warm-up, graphs);
7. ``expert cache``: the resident experts (MoE models), sized from what is left (docs/DESIGN.md
   "Slots after the weights and the session") minus the reserve and the draft head's bind buffers (the
   C++ engine's reserve: ``--vram-reserve-mib`` + draft-head bind bytes); refused with the numbers when
   less than that is free (docs/DESIGN.md "The reserve and the prompt buffers");
8. ``bind`` (with a draft head): its bind buffers, into the room the cache left for them.

Everything else the engine will hold is allocated before the expert cache measures what is free, so
the cache takes exactly what is left minus the reserve, and after start-up the device checks that the
reserve is still free (measured): a start that ate it is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from strata.budget import formulas as F
from strata.layout import kv as LK
from strata.manifests.contract import Geometry, geometry_from_params
from strata.manifests.keys import KeysRefusedError
from strata.packer.pack import Pack, open_pack
from strata.packer.pack_geometry import pack_geometry
from strata.packer.packfmt import METADATA_FILE, POOL_FILE, sources_modified, sources_retargeted

from .checkpoints import Checkpoint, Checkpoints
from .core import Device, Engine
from .cpu.device import CpuDevice
from .decoder import Decoder
from .errors import GenerateError, StartupRefused
from .loader import LoadError, LoadPlan, check_pack
from .models import UnsupportedModel, recipe_for
from .numerics import numerics as get_numerics
from .options import DEVICES, EngineOptions
from .tokenizer import load_tokenizer


def open_checked(
    pack_dir: str | Path, *, runnable: bool = False, source_dir: str | Path | None = None
) -> tuple[Pack, Geometry, LoadPlan]:
    """The ``pack`` stage: open the pack with the strict readers, rebuild its geometry through the
    manifest, honour or refuse every metadata key of ``metadata.txt`` that llama.cpp reads for the
    architecture (the manifest's ``[keys]``: :func:`strata.packer.pack_geometry.pack_geometry`, the rule
    ``strata-pack build`` and ``strata-budget check`` apply) and assert every tensor's shape
    (:func:`loader.check_pack`). ``runnable``: first refuse an architecture the engine has no forward
    pass for (named, before any type or shape check). ``source_dir``: where the source shards are now
    (:meth:`strata.packer.pack.Pack.source_path`).

    Raises:
        PackFormatError, ManifestError, LoadError: as the callees do, before any weight is read; LoadError
            also for what :func:`strata.packer.pack_geometry.pack_geometry` finds (the rule ``strata-budget check``
            applies): a geometry.txt that disagrees with metadata.txt (every param named with both values),
            metadata.txt that does not resolve or names another architecture, a missing vocab.parquet.
        UnsupportedModel: ``runnable`` and no model file for the pack's architecture; a metadata key
            whose value strata does not implement (metadata.txt, the key, the value and what strata
            implements named).
    """
    pool = Path(pack_dir) / POOL_FILE
    if pool.exists() and not pool.is_file():
        raise LoadError(
            f"{pool}: not a file (a {'directory' if pool.is_dir() else 'special file'}); the dense "
            f"weights pool must be a regular file"
        )
    pack = open_pack(pack_dir, source_dir)
    if runnable:
        recipe_for(pack.arch)
    # the rule strata-budget check applies: geometry.txt (what the engine runs) agrees with metadata.txt, and every
    # metadata key llama.cpp reads is honoured or refused - the disagreements first (an edited geometry.txt names its
    # param, not a key refusal it causes)
    geom = geometry_from_params(pack.arch, pack.geometry_params)  # unreadable params: its ManifestError, as it is
    pg = pack_geometry(pack)
    if pg.findings:
        raise LoadError("; ".join(f"{pack.path / f.file}: {f.message}" for f in pg.findings))
    if pg.refusals:
        e = KeysRefusedError("; ".join(r.message for r in pg.refusals), pg.refusals)
        raise UnsupportedModel(str(e.with_file(pack.path / METADATA_FILE)))
    return pack, geom, check_pack(pack, geom)


def check_sources(pack, shards: list[Path], on_warning: Callable[[str], None] | None) -> None:
    """The source shards the experts are read from, against the build record: a shard that now resolves to another
    file (a retargeted symlink, moved sources) or whose mtime changed has its experts' samples re-read
    (:func:`strata.packer.verify.check_expert_samples`, what ``strata-pack verify`` does) and a difference is
    refused - dense weights of one file with experts of another decode to plausible logits; same bytes after a
    change of mtime are said in a warning.

    Raises:
        LoadError: samples that differ (the layer, the shards and both digests).
    """
    from strata.packer.verify import VerifyError, check_expert_samples

    moved = sources_retargeted(pack.path, shards)
    touched = sources_modified(pack.path, shards)
    if pack.experts is None or not (moved or touched):
        return
    try:
        check_expert_samples(pack, shards)
    except VerifyError as e:
        names = ", ".join(str(p) for p in moved + [t for t in touched if t not in moved])
        raise LoadError(f"{names}: not the source the pack was built from: {e}") from None
    for p in touched if on_warning is not None else ():
        on_warning(
            f"{p}: modified since the pack was built (mtime differs); its experts' samples still match the build "
            "record (strata-pack verify re-reads every layer's)"
        )


def kv_cache_need_bytes(model: Decoder, n_ctx: int, kv: str, sliding: str = "ring") -> int:
    """Bytes the KV cache of ``model`` takes for ``n_ctx`` positions at ``kv``, from the budget's
    :func:`strata.layout.kv.kv_cache_bytes` (the figure ``strata-budget`` plans; sliding-window
    layers as rings unless ``sliding="full"``)."""
    h = model.hp
    windows = model.layer_windows() if sliding == "ring" else [None] * h.n_layer
    layers = [
        LK.KVLayer(il, h.n_head_kv * h.head_dim, h.n_head_kv * h.head_dim_v, model.indexer_head_dim, w)
        for il, w in enumerate(windows)
        if model.attn[il] is not None
    ]
    return LK.kv_cache_bytes(layers, n_ctx, LK.ENGINE_PREFILL_CHUNK, kv, 1)


def check_ctx(
    model: Decoder,
    geom: Geometry,
    n_ctx: int,
    kv: str,
    available: int,
    what: str,
    sliding: str = "ring",
    on_warning: Callable[[str], None] | None = None,
) -> int:
    """Refuse an ``n_ctx`` whose KV cache does not fit in ``available`` bytes (``what`` names that
    memory), before any weight is loaded; warn (``on_warning``) past the model's ``n_ctx_train``.
    Returns the KV cache bytes.

    Raises:
        GenerateError: the KV cache alone needs more than ``available``.
    """
    need = kv_cache_need_bytes(model, n_ctx, kv, sliding)
    if need > available:
        raise GenerateError(
            f"--ctx {n_ctx}: the KV cache ({kv}) would need {need} bytes ({F.mib(need):.1f} MiB, "
            f"strata.layout.kv.kv_cache_bytes), more than the {available} bytes "
            f"({F.mib(available):.1f} MiB) of {what}; lower --ctx"
        )
    train = geom.get("n_ctx_train")
    if on_warning is not None and train and n_ctx > int(train):
        on_warning(
            f"--ctx {n_ctx} exceeds the model's training context n_ctx_train {int(train)} (geometry.txt); "
            f"positions past it are outside what the model was trained on"
        )
    return need


def make_device(name: str, **kw) -> Device:
    """The device called ``name`` (:data:`strata.engine.options.DEVICES`); ``kw`` go to the GPU device
    (``backend``, ``card``).

    Raises:
        GenerateError: an unknown device (naming the known ones); the GPU device's own refusal
            (no CuPy, no GPU) with the reason.
    """
    if name == "cpu":
        return CpuDevice()
    if name in ("cuda", "sim"):
        from .gpu.device import GpuDevice

        return GpuDevice(name, **kw)
    raise GenerateError(f"--device {name!r}: expected one of {', '.join(DEVICES)}")


def load_engine(
    pack_dir: str | Path,
    *,
    device: str | Device | None = None,
    options: EngineOptions | None = None,
    on_checkpoint: Callable[[Checkpoint], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    **kw,
) -> Engine:
    """Open, check and load the pack at ``pack_dir`` on ``device`` (stages in the module docstring).

    Options come as ``options`` (:class:`strata.engine.options.EngineOptions`, checked when it was made) or
    as its keywords (``n_ctx=256, kv="f32"``); ``device`` is a device name (default ``options.device``, else
    ``cpu``) or a :class:`Device`; ``backend=`` passes a GPU backend (``strata.engine.gpu.backend``) to the
    GPU device. The options are resolved once, in the ``pack`` stage (:meth:`EngineOptions.resolve`).

    Raises:
        PackFormatError: a pack file that does not follow the format (file and line named).
        ManifestError: geometry.txt that does not satisfy the architecture's manifest.
        LoadError: a tensor or expert table that disagrees with the geometry (name, found, required).
        UnsupportedModel: an architecture or feature without a forward pass here.
        TokenizerError: tokenizer data that cannot be built.
        GenerateError: what :class:`EngineOptions` refuses (before any device is touched); options for
            one device given with another; a context whose KV cache does not fit the device's memory, an
            expert cache N that does not fit (both numbers).
    """
    backend = kw.pop("backend", None)
    name = device if device is None or isinstance(device, str) else device.name
    asked = options if options is not None else EngineOptions(device=name or "cpu", **kw)
    if name is not None and name != asked.device:
        raise GenerateError(f"options made for --device {asked.device} given to load on {name}")
    if device is None or isinstance(device, str):
        dkw = {"backend": backend} if backend else {}
        if asked.card is not None and backend is None:
            dkw["card"] = asked.card
        dev = make_device(asked.device, **dkw)
    else:
        dev = device
    nx = get_numerics(asked.numerics)
    cps = Checkpoints(on_checkpoint)
    with cps.stage("pack") as note:
        pack, geom, plan = open_checked(pack_dir, runnable=True, source_dir=asked.source_dir)
        recipe = recipe_for(pack.arch)
        opts = asked.resolve(int(geom["n_ctx_train"]))  # every default decided, once
        dev.configure(opts)
        note["arch"] = pack.arch
        note["device"] = dev.describe()
        note["numerics"] = nx.name
        note["tensors checked"] = len(plan.dense)
        note["expert layers checked"] = len(plan.experts)
        check_sources(pack, [plan.shard_paths[k] for k in sorted(plan.shard_paths)], on_warning)
        if opts.profile is not None:  # the budget's rule, before anything is loaded
            from strata.budget.errors import BudgetInputError
            from strata.budget.profile import check_profile_model, check_profile_pairs

            if not plan.experts:
                raise GenerateError(
                    f"expert profile: this {pack.arch} model has no routed experts, so there is no "
                    f"expert cache for its {len(opts.profile)} (layer, expert) pairs to fill"
                )
            try:
                if opts.profile_source is not None:  # recorded on this model, not another (the file says which)
                    check_profile_model(opts.profile_source, pack)
                check_profile_pairs(opts.profile, set(plan.experts), int(geom["n_expert"]))
            except BudgetInputError as e:
                raise GenerateError(str(e)) from None
        dev.mark("pack", note)

    weights = dev.make_weights(pack, plan, nx)
    experts = dev.make_experts(plan, nx) if plan.experts else None
    model = Decoder(geom, recipe, weights, experts)
    avail, what = dev.memory_available()
    check_ctx(model, geom, opts.n_ctx, opts.kv, avail, what, opts.sliding, on_warning)
    head = set(model.head_tensors())
    rows_only = set(model.row_tensors())
    got: dict = {}

    def weights_stage(note):
        dev.load_weights(weights, [n for n in plan.dense if n not in head and n not in rows_only], "weights", note)
        note["kept quantized (rows on demand)"] = ",".join(sorted(rows_only)) or "-"

    def head_stage(note):
        dev.load_weights(weights, sorted(head), "head", note)
        note["tensor"] = model.head

    def session_stage(note):
        got["state"] = dev.open_session(model, opts, note)
        got["tokenizer"] = load_tokenizer(pack)
        for w in got["tokenizer"].warnings if on_warning is not None else ():
            on_warning(w)

    def cache_stage(note):
        if experts is not None:
            dev.open_expert_cache(experts, geom, opts, note)
            # the shards' page tables filled in the background (no page fault when a miss first reads an expert);
            # not with a host tier holding every miss that the token path reads (a split's CPU reads it too, where
            # the tier holds native bytes): then no shard is read
            info = getattr(dev, "info", None)  # (the GPU's: where its misses run; the CPU path has none)
            moe = getattr(getattr(dev, "decoder", None), "moe", None)
            cpu_tier = info is not None and info.miss_tier.startswith("cpu")
            on_cpu = cpu_tier or (info is not None and "miss split" in note)
            if moe is not None and on_cpu and "cpu experts" not in note:  # (the split's choice may have measured)
                from .gpu.slots import cpu_experts_note

                cpu_experts_note(experts, moe, note)  # before the prefetch: its reads would slow the probe's
            shards = cpu_tier or (on_cpu and (moe is None or moe.cpu_reads_shards))
            note["shard prefetch"] = (
                "not needed (every miss is read from the host tier" + (", the CPU's too)" if on_cpu else ")")
                if note.get("host_tier_pairs") and not shards
                else experts.source.prefetch()
            )
        else:
            note["resident"] = "none (dense model)"

    run = {
        "weights": weights_stage,
        "head": head_stage,
        "session": session_stage,
        "drafter": lambda note: dev.load_drafter(pack, plan, model, note),
        "prompt path": lambda note: got.__setitem__("runner", dev.prompt_path(model, got["state"], opts, note)),
        "expert cache": cache_stage,
        "bind": lambda note: dev.bind_drafter(plan, model, opts, note),
    }
    for stage in stage_order(opts.stage_order, bool(plan.draft)):
        with cps.stage(stage) as note:
            try:
                run[stage](note)
            except MemoryError as e:  # a real card's CuPy OutOfMemoryError, or an emulated card's refusal
                cls = type(e) if isinstance(e, GenerateError) else StartupRefused
                raise cls(f"start-up stage {stage!r}: {e}") from e
            dev.mark(stage, note)
    runner, state, tokenizer = got["runner"], got["state"], got["tokenizer"]
    eng = Engine(
        pack,
        geom,
        plan,
        weights,
        runner,
        tokenizer,
        state,
        experts,
        cps.done,
        device=dev.name,
        kv=opts.kv,
        options=opts,
    )
    eng.notes = unused_notes(recipe, plan)
    dev.finish(eng)
    return eng


#: Every start-up stage in the order it runs (module docstring; ``drafter`` and ``bind`` only for a pack
#: with NextN draft blocks). ``pack`` always comes first.
STAGES = ("pack", "weights", "head", "session", "drafter", "prompt path", "expert cache", "bind")


def stage_order(order: tuple[str, ...] | list[str] | None, draft: bool) -> list[str]:
    """The stages after ``pack`` in the order they run: :data:`STAGES` (without ``drafter`` and ``bind``
    when there is no draft head), or ``order`` - a test's reordering (docs/DESIGN.md "The head before the
    cache" is shown by loading the head after the cache: the reserve is eaten and the start is
    refused at the end, :meth:`strata.engine.gpu.device.GpuDevice.finish`).

    Raises:
        GenerateError: an order that is not a permutation of those stages, or that opens the session
            after the prompt path or binds the drafter before loading it.
    """
    default = [st for st in STAGES[1:] if draft or st not in ("drafter", "bind")]
    if order is None:
        return default
    got = list(order)
    if sorted(got) != sorted(default):
        raise GenerateError(f"stage order {got}: expected a permutation of {default}")
    for a, b in (("session", "prompt path"), ("drafter", "bind")):
        if a in got and got.index(a) > got.index(b):
            raise GenerateError(f"stage order {got}: {a!r} must come before {b!r}")
    return got


def unused_notes(recipe, plan: LoadPlan) -> list[str]:
    """One line per group of tensors the pack holds that the recipe knowingly does not read
    (:attr:`strata.engine.recipe.Recipe.unused`), naming how many."""
    out = []
    for prefix, line in recipe.unused.items():
        n = sum(1 for name in plan.dense if name.split(".", 2)[-1].startswith(prefix))
        if n:
            out.append(f"{line} ({n} tensors)")
    return out


__all__ = [
    "Device",
    "Engine",
    "STAGES",
    "check_ctx",
    "kv_cache_need_bytes",
    "load_engine",
    "make_device",
    "open_checked",
    "stage_order",
]
