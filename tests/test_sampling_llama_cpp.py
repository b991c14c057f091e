"""strata's sampler chain against llama.cpp's own (issue 21 item 11, sampling): llama-cpp-python 0.3.36's
low-level sampler API (src/llama-sampling.cpp of its vendored tree) on the same logits and history. The draws use
different generators (std::mt19937 there), so what is compared is what each draw comes from: the tokens the chain
leaves and their logits after the temperature, bit for bit (f32)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from strata.engine.sampling import Sampler


def _llama_chain(L, logits, history, *, top_k, top_p, min_p, temp, repeat, last_n, freq, present):
    """llama.cpp's default order (common/common.h): penalties, top-k, top-p, min-p, temperature; returns
    ``{id: logit}`` of the tokens left."""
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    # the vendored llama.h of 0.3.36 still takes n_vocab first
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(len(logits), last_n, repeat, freq, present))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(top_k))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(top_p, 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(min_p, 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temp))
    try:
        for t in history:
            L.llama_sampler_accept(chain, int(t))
        n = len(logits)
        arr = (L.llama_token_data * n)(*[L.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits)])
        cur = L.llama_token_data_array(arr, n, -1, False)
        L.llama_sampler_apply(chain, ctypes.byref(cur))
        return {int(arr[i].id): np.float32(arr[i].logit) for i in range(cur.size)}
    finally:
        L.llama_sampler_free(chain)


@pytest.mark.llama_cpp
def test_sampler_chain_leaves_what_llama_cpps_leaves(llama_cpp):
    rng = np.random.default_rng(0)
    cases = [
        dict(top_k=20, top_p=0.8, min_p=0.05, temp=0.7, repeat=1.3, last_n=8, freq=0.2, present=0.1),
        dict(top_k=0, top_p=0.95, min_p=0.0, temp=1.5, repeat=1.0, last_n=64, freq=0.0, present=0.0),
        dict(top_k=40, top_p=1.0, min_p=0.1, temp=0.3, repeat=1.1, last_n=-1, freq=0.0, present=0.5),
        dict(top_k=5, top_p=0.5, min_p=0.0, temp=4.0, repeat=1.0, last_n=0, freq=1.0, present=1.0),
    ]
    order_matters = False
    for trial in range(24):
        c = cases[trial % len(cases)]
        logits = rng.normal(0, 2, 200).astype(np.float32)
        history = rng.integers(0, 200, 40).tolist()
        # llama.cpp's top-k 0 keeps every token; llama-cli's --repeat-last-n -1 is the context (common/arg.cpp sets
        # the sampler's window to n_ctx; the sampler itself clamps -1 to 0, off): the whole history here
        want = _llama_chain(
            llama_cpp, logits, history, **(c | {"last_n": len(history) if c["last_n"] == -1 else c["last_n"]})
        )
        s = Sampler(
            temperature=c["temp"],
            top_k=c["top_k"],
            top_p=c["top_p"],
            min_p=c["min_p"],
            repeat_penalty=c["repeat"],
            repeat_last_n=c["last_n"],
            frequency_penalty=c["freq"],
            presence_penalty=c["present"],
        )
        idx, p = s.candidates(logits, history)
        assert sorted(idx.tolist()) == sorted(want), (trial, c)
        pen = s.penalize(logits, history)
        got = {int(i): pen[i] / np.float32(c["temp"]) for i in idx}
        assert all(got[i].tobytes() == want[i].tobytes() for i in want), (trial, c)
        # the order is what the test checks: top-p on the tempered softmax (strata before) leaves another set
        if c["top_p"] < 1.0:
            z = np.sort(pen.astype(np.float64))[::-1][: c["top_k"] or None] / c["temp"]
            q = np.exp(z - z[0])
            q /= q.sum()
            order_matters |= int(np.searchsorted(np.cumsum(q), c["top_p"]) + 1) != len(want)
    assert order_matters
