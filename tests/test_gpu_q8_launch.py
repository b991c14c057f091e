"""The q8 kernels' launch shape (strata.engine.gpu.kernels.q8_launch, q8_shape) - plain Python, checked in CI without a
GPU: how many warps share a row, how many rows a CTA takes, the shared memory of the block terms, and the refusals.
The kernels themselves run on the GPU machine (tests/test_gpu_q8.py: the same bits at every split)."""

from __future__ import annotations

import pytest

from strata.engine.gpu import launch_shape as K
from strata.packer import quants


def _k(name: str) -> K.Q8Kernels:
    t = quants.by_name(name).id
    qk, bpi, terms = K.q8_shape(t)
    return K.Q8Kernels(t, K.q8_act_format(t), None, None, None, qk=qk, bpi=bpi, terms=terms)


def test_q8_shape_reads_the_lane_code():
    """256-value K-quants step 4 blocks a warp (8 lanes a block); 32-value types 8 (4 lanes); a min adds a term."""
    assert K.q8_shape(quants.by_name("Q4_K").id) == (256, 4, 2)
    assert K.q8_shape(quants.by_name("Q6_K").id) == (256, 4, 1)
    assert K.q8_shape(quants.by_name("Q8_0").id) == (32, 8, 1)
    assert K.q8_shape(quants.by_name("Q5_0").id) == (32, 8, 1)
    with pytest.raises(ValueError, match="F32"):
        K.q8_shape(quants.by_name("F32").id)


@pytest.mark.skipif(
    K.Q8_WARPS != 4 or K.Q8_SPLIT != "auto" or K.Q8_SPLIT_STEPS != 4,
    reason="not the default launch shape (env)",
)
def test_q8_launch_shape_at_the_defaults():
    """4 warps a CTA: a row of 4 warp steps or more over all 4, a shorter one a warp a row; the CTA takes 4 // split
    rows; the shared terms are 4 B x terms x blocks per row of the CTA (none at split 1)."""
    q4k, q80 = _k("Q4_K"), _k("Q8_0")
    assert K.q8_launch(q4k, 2048, 4096) == (2048, 128, 16 * 2 * 4, 4)  # 16 blocks: 4 steps, a row a CTA
    assert K.q8_launch(q4k, 2048, 2048) == (512, 128, 0, 1)  # 8 blocks: 2 steps, a warp a row
    assert K.q8_launch(q4k, 2049, 768) == (513, 128, 0, 1)  # 3 blocks: 1 step; 2049 rows: 513 CTAs
    assert K.q8_launch(q4k, 2048, 2048, split=2) == (1024, 128, 2 * 8 * 2 * 4, 2)  # 2 rows a CTA
    assert K.q8_launch(q80, 10, 1024) == (10, 128, 32 * 4, 4)  # 32 blocks: 4 steps


def test_q8_launch_refusals_name_the_numbers():
    """A split that does not divide the CTA's warps, and a row whose shared terms pass the 48 KiB a CTA may take:
    refused, naming the split / the row length and both byte counts."""
    q4k = _k("Q4_K")
    with pytest.raises(ValueError, match=rf"q8 split 3: must divide the {K.Q8_WARPS} warps of a CTA"):
        K.q8_launch(q4k, 10, 1024, split=3)
    ne0 = 256 * (K.Q8_SHMEM_MAX // 8 + 1)  # one row's 2 terms a block pass the limit
    need = ne0 // 256 * 2 * 4
    with pytest.raises(ValueError, match=rf"a row of {ne0} values needs {need} B of shared terms > {K.Q8_SHMEM_MAX} B"):
        K.q8_launch(q4k, 1, ne0, split=K.Q8_WARPS)
