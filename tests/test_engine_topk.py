"""``top_k_pairs`` (the top-5 the decode loop records every step): the block-maximum route for long
rows gives exactly what the partition definition gives - ids, values, order, ties by id."""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine.sampling import _top_k_pairs_partition, top_k_pairs


@pytest.mark.parametrize("seed", range(12))
def test_top_k_pairs_equals_definition(seed):
    rng = np.random.default_rng(seed)
    n = 262144 if seed % 3 == 0 else int(rng.integers(4096, 200000))
    x = rng.standard_normal(n).astype(np.float32)
    if seed % 2:
        x = np.round(x * 2).astype(np.float32)  # many ties across blocks: order by id decides
    if seed % 4 == 1:
        x[rng.integers(0, n, 50)] = -np.inf
    if seed % 5 == 2:
        x[:] = np.float32(0.5)  # everything tied
        x[rng.integers(0, n, 3)] = np.float32(0.75)
    for k in (1, 2, 5, 7, 64):
        assert top_k_pairs(x, k) == _top_k_pairs_partition(x, k), (n, k)


def test_top_k_pairs_nan_and_short_rows_take_the_definition():
    x = np.random.default_rng(0).standard_normal(8192).astype(np.float32)
    x[100] = np.nan
    assert top_k_pairs(x, 5) == _top_k_pairs_partition(x, 5)
    assert top_k_pairs(np.float32([1, 3, 3, 2]), 3) == [(1, 3.0), (2, 3.0), (3, 2.0)]
    assert top_k_pairs(np.float32([1, 2]), 5) == [(1, 2.0), (0, 1.0)]
