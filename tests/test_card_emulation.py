"""Card emulation (strata-engine --card): the emulated-free-memory arithmetic, the allocation hook and
the baseline (with a stand-in for CuPy: CPU only), the simulated card, and the command line.

The H200 runs of the same code are in tests/test_startup_reserve_gpu.py (gpu-marked) and bench/device_docs.sh."""

from __future__ import annotations

import pytest

from strata.budget import formulas as F
from strata.budget import formulas_gpu as FG
from strata.budget.cards import CardError, card_from_mib, card_from_options, card_preset
from strata.engine.gpu.card import CardEmulation, CardOutOfMemory

H200_TOTAL = 150_754_820_096  # cudaMemGetInfo total of an H200 (bytes)
CTX = 552_402_944  # the H200's CUDA context (cards.toml [defaults], measured with NVML)
C24 = card_preset("24G")  # 25,386,352,640 B


def test_emulated_free_is_the_card_minus_what_this_process_holds():
    # right after the context: the process holds its context only
    free_phys = H200_TOTAL - CTX
    assert FG.emulated_used_bytes(H200_TOTAL, free_phys, 0) == CTX
    assert FG.emulated_free_bytes(C24.total_bytes, H200_TOTAL, free_phys, 0) == 25_386_352_640 - 552_402_944
    # 4 GiB of weights later, with 10 GiB held by another process since before the start (not charged)
    other = 10 << 30
    free_phys = H200_TOTAL - other - CTX - (4 << 30)
    assert FG.emulated_used_bytes(H200_TOTAL, free_phys, other) == CTX + (4 << 30)
    assert FG.emulated_free_bytes(C24.total_bytes, H200_TOTAL, free_phys, other) == 25_386_352_640 - CTX - (4 << 30)
    # never negative, and an allocation fits while the process holds at most the card
    assert FG.emulated_free_bytes(8 << 30, H200_TOTAL, H200_TOTAL - (9 << 30), 0) == 0
    assert FG.emulated_allocation_fits(C24.total_bytes, C24.total_bytes)
    assert not FG.emulated_allocation_fits(C24.total_bytes, C24.total_bytes + 1)


def test_the_slot_count_on_the_emulated_card_is_the_budget_formula():
    """The automatic cache size on an emulated card: size_expert_cache on the EMULATED free bytes."""
    held = CTX + 5_000_000_000  # context + weights, head, session, prompt path
    free = FG.emulated_free_bytes(C24.total_bytes, H200_TOTAL, H200_TOTAL - held, 0)
    size = F.size_expert_cache(free, 700 * F.MIB, 2_176_000, 48 * 512)
    assert size.slots == (25_386_352_640 - held - 700 * 2**20) // 2_176_000 == 8777
    # on the physical H200 the same start would take every pair: the card decides the result
    assert F.size_expert_cache(H200_TOTAL - held, 700 * F.MIB, 2_176_000, 48 * 512).slots == 48 * 512


# ------------------------------------------------------------------ a stand-in for CuPy (no GPU here)


class FakeBlock:
    """A pool block: going out of scope gives it back to the pool's cache (as CuPy's MemoryPointer)."""

    def __init__(self, pool, size):
        self.pool, self.size = pool, size

    def __del__(self):
        self.pool.cached += self.size


class FakePool:
    def __init__(self, dev):
        self.dev, self.held, self.cached = dev, 0, 0

    def malloc(self, size):
        size = -(-size // 512) * 512
        if self.cached >= size:  # served from a cached block: no new device memory
            self.cached -= size
            return FakeBlock(self, size)
        self.held += size
        self.dev.used += size
        return FakeBlock(self, size)

    def total_bytes(self):
        return self.held

    def used_bytes(self):
        return self.held - self.cached

    def free_all_blocks(self):
        self.dev.used -= self.cached
        self.held -= self.cached
        self.cached = 0


class FakeCupy:
    """memGetInfo, the default pool and set_allocator: what CardEmulation touches."""

    def __init__(self, total=H200_TOTAL, used=CTX):
        self.total, self.used = total, used
        self.pool = FakePool(self)
        self.allocator = self.pool.malloc
        outer = self

        class runtime:
            @staticmethod
            def memGetInfo():
                return outer.total - outer.used, outer.total

        class cuda:
            pass

        cuda.runtime = runtime
        cuda.set_allocator = lambda f: setattr(outer, "allocator", f)
        self.cuda = cuda

    def get_default_memory_pool(self):
        return self.pool


def test_baseline_fresh_process_measures_the_context_with_nvml(monkeypatch):
    import strata.engine.gpu.card as card_mod

    other = 3 << 30  # another process held 3 GiB before this one started
    cp = FakeCupy(used=other + CTX)
    monkeypatch.setattr(card_mod, "nvml_memory", lambda device=0: (H200_TOTAL, 1_000_000 + other + CTX, "H200"))
    emu = CardEmulation.start(C24, cp, (H200_TOTAL, 1_000_000 + other, "H200"))
    assert (emu.context_bytes, emu.other_bytes, emu.physical_total) == (CTX, other, H200_TOTAL)
    assert emu.free(cp.total - cp.used) == C24.total_bytes - CTX
    assert "NVML" in emu.how and cp.allocator is not cp.pool.malloc  # the hook is installed


def test_baseline_when_cuda_was_used_before_takes_the_planned_context():
    cp = FakeCupy(used=CTX + (1 << 30))  # context + 1 GiB of modules and cached blocks from earlier engines
    cp.pool.held = 256 << 20
    emu = CardEmulation.start(C24, cp, None)
    assert emu.context_bytes == C24.cuda_context_bytes == 527 * F.MIB
    assert emu.other_bytes == CTX + (1 << 30) - (256 << 20) - 527 * F.MIB
    # what the pool still caches counts against the card; the rest of the earlier use does not
    assert emu.used(cp.total - cp.used) == (256 << 20) + 527 * F.MIB


def test_an_allocation_past_the_card_fails_as_on_the_card():
    card = card_from_mib(2048, cuda_context_mib=0)
    cp = FakeCupy(used=CTX)
    emu = CardEmulation.start(card, cp, None)  # context taken as planned (0 here): others = the H200's context
    alloc = cp.allocator
    kept = [alloc(1 << 30)]  # 1 GiB: held 1 GiB of 2 GiB
    assert emu.used(cp.total - cp.used) == 1 << 30
    with pytest.raises(
        CardOutOfMemory,
        match=r"out of memory on the emulated card 2048 MiB card: an allocation of "
        r"1610612736 B .* of the card's 2147483648 B .* fails as it would on that card",
    ):
        alloc(1536 << 20)
    assert emu.refused == 1 and cp.pool.held == 1 << 30  # the block was given back
    cp.pool.cached, cp.pool.held, cp.used = 512 << 20, cp.pool.held + (512 << 20), cp.used + (512 << 20)
    kept.append(alloc(512 << 20))  # a block the pool caches is reused without new device memory: never refused
    kept.append(alloc(388 << 20))  # new memory, still inside the card
    assert emu.used(cp.total - cp.used) == (1 << 30) + (900 << 20) and len(kept) == 3
    CardEmulation.uninstall(cp)
    assert cp.allocator == cp.pool.malloc


def test_card_options_for_the_engine():
    assert card_from_options("24GB", None, allow_measure=False).total_bytes == 25_386_352_640
    assert card_from_options(None, 6000, allow_measure=False).total_bytes == 6000 * F.MIB
    with pytest.raises(CardError, match="--card measure: the engine runs on the local GPU"):
        card_from_options("measure", None, allow_measure=False)
    with pytest.raises(CardError, match="not both"):
        card_from_options("24G", 100)
    with pytest.raises(CardError, match="unknown card '23G'"):
        card_from_options("23G", None, allow_measure=False)


# ------------------------------------------------------------------ the simulated card (CI)


@pytest.fixture(scope="module")
def moe_pack(qwen3moe_pack):
    return qwen3moe_pack  # tests/conftest.py


def test_sim_card_checkpoints_show_the_card(moe_pack):
    from strata.engine.startup import load_engine

    card = card_from_mib(600, cuda_context_mib=527)
    eng = load_engine(moe_pack, device="sim", n_ctx=64, card=card, vram_reserve_mib=40)
    for cp in eng.checkpoints:
        assert cp.extra["gpu_total_bytes"] == 600 * F.MIB
        assert cp.extra["gpu_used_bytes"] >= 527 * F.MIB
    sp = eng.gpu.slot_plan
    assert sp.free_bytes == eng.checkpoints[-2].extra["gpu_free_bytes"]
    assert sp.slots == F.expert_slots(sp.free_bytes, 40 * F.MIB, sp.slot_bytes, sp.cap)
    assert "600 MiB card simulated" in eng.gpu.device


def test_sim_card_too_small_for_the_weights_is_refused_with_the_numbers(moe_pack):
    from strata.engine.gpu.backend import SimBackend
    from strata.engine.startup import load_engine

    bk = SimBackend(total_bytes=CTX + 200_000, context_bytes=CTX, card_name="tiny card")  # the KV cache fits, no more
    with pytest.raises(
        CardOutOfMemory,
        match=r"start-up stage 'weights': out of memory on the simulated card tiny card: "
        r"an allocation of \d+ B with 552402944 B held "
        r"\(CUDA context included\) of the card's 552602944 B - the allocation fails",
    ):
        load_engine(moe_pack, device="cuda", ubatch=1, n_ctx=64, backend=bk)


def test_card_on_the_cpu_path_is_refused(moe_pack):
    from strata.engine.errors import GenerateError
    from strata.engine.startup import load_engine

    with pytest.raises(GenerateError, match="--card 24G .*emulated on the GPU path; add --device cuda"):
        load_engine(moe_pack, device="cpu", n_ctx=64, card=C24)


def test_cli_card_options(moe_pack):
    from click.testing import CliRunner

    from strata.engine.cli import main

    r = CliRunner().invoke(main, ["generate", str(moe_pack), "-p", "hi", "--card", "measure", "--device", "cuda"])
    assert r.exit_code == 2 and "--card measure: the engine runs on the local GPU" in r.output
    r = CliRunner().invoke(main, ["generate", str(moe_pack), "-p", "hi", "--card", "24G"])
    assert r.exit_code == 2 and "add --device cuda" in r.output
    r = CliRunner().invoke(main, ["generate", "--help"])
    assert "--card" in r.output and "--card-mib" in r.output
