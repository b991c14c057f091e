"""Synthetic models whose routing means something, and prompt sets with topic runs.

A pattern-filled model (``ModelSpec.fill="pattern"``) tiles ~64 KiB of random blocks over every tensor, so
its router repeats rows every few experts (Qwen3-30B-A3B's shape: a 2048-wide f32 row is 8 KiB, 8
distinct rows for 128 experts): the logits tie and every token goes to the same few low-index experts,
and its token_embd repeats rows every few tokens (30 distinct rows at n_embd 2048, Q8_0). A hit rate
measured on such a file means nothing. ``ModelSpec.routing = TokenRouting(...)`` changes two things
(default None: the file's bytes are unchanged):

- every router ``blk.N.ffn_gate_inp.weight`` (ne ``[n_embd, n_expert]``) is drawn row by row from its
  tensor's stream (:func:`router_values`), whatever the fill, with a stated skew: expert ``e``'s row is
  ``w_e = exp(skew * z_e) * g_e`` with ``z_e ~ N(0, 1)`` (drawn first, one per expert, per layer) and
  ``g_e ~ N(0, weight_std^2 I)``. The logit ``w_e . x`` of a row scaled by ``s_e`` is ``s_e`` times an
  unscaled one, so a larger ``s_e`` reaches the top-k more often (``k < n_expert / 2``): some experts are
  hotter, as in trained models (lognormal row norms). ``skew = 0`` is uniform; ``z`` and ``g`` do not
  depend on the skew, so changing it changes only the concentration. (The shared expert's gate
  ``ffn_gate_inp_shexp`` and the selection biases are vectors, already drawn value by value.)
- with ``fill="pattern"``, ``token_embd`` and ``output`` get ``R = min(embd_rows, n_vocab)`` distinct rows
  of values ``N(0, embd_std^2)`` (drawn from the tensor's stream; K / IQ types keep the block law of
  :func:`~strata.testing.blocks.make_random_blocks`, ``|x| <= 0.25``), cycled: row ``i`` is row ``i mod R``
  (:func:`token_rows`). Drawing all 151,936 rows of a 30B-shaped vocabulary through gguf-py's Q8_0
  quantizer takes over a minute; 4096 rows take ~3 s. Token ids below ``R`` (:func:`topic_prompts` draws
  from ``range(vocab)``) never share a row, and greedy decoding's argmax lands below ``R`` (ties go to the
  lowest id). With ``fill="random"`` every row is drawn already and stays as it was.

The hidden state that reaches a router is the token's embedding plus the attention and expert outputs
(pattern-filled, but input-dependent). Those outputs are large beside a ``weight_std`` (0.02) embedding
(std ~0.3 per value at n_embd 1024-2048, and ever more alike along a prompt as attention averages it), so
with such an embedding every token routes nearly alike; ``embd_std = 1`` makes the token dominate: the
choice depends on the token and, less, on its context (measured: tests/test_synth_routing.py).

:func:`topic_prompts` makes prompt sets with temporal locality: topics are token subsets, prompts come in
runs of one topic (a documented, seeded law), so a cache sees recurring experts within a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from strata.packer import quants

from .blocks import encode_floats, pattern_fill

__all__ = [
    "PromptSet",
    "TokenRouting",
    "router_scales",
    "router_values",
    "routing_tensor_data",
    "token_rows",
    "topic_prompts",
]

#: Base names of the tensors whose rows carry the token: drawn as distinct rows under ``fill="pattern"``.
TOKEN_ROW_TENSORS = ("token_embd.weight", "output.weight")
#: Suffix of a layer's router (ne ``[n_embd, n_expert]``).
ROUTER_SUFFIX = ".ffn_gate_inp.weight"


class TokenRouting(BaseModel):
    """Token-dependent routing of a synthetic model (``ModelSpec.routing``; the module docstring has the law).

    Attributes:
        skew: ``>= 0``; expert ``e``'s router row is scaled by ``exp(skew * z_e)``, ``z_e ~ N(0, 1)`` per
            layer. 0: every expert alike. About 1: a few experts take several times their share.
        embd_rows: distinct rows of ``token_embd`` / ``output`` under ``fill="pattern"`` (cycled over the
            vocabulary; at most ``n_vocab`` are drawn).
        embd_std: std of those rows' values (float and gguf-quantizable types).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    skew: float = Field(0.0, ge=0.0, le=8.0)
    embd_rows: int = Field(4096, ge=1)
    embd_std: float = Field(1.0, gt=0.0)


def router_scales(n_expert: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """Per-expert row scales ``exp(skew * z)``, ``z ~ N(0, 1)`` drawn from ``rng`` (``n_expert`` draws,
    whatever the skew). Returns float64 ``(n_expert,)``, all > 0; all 1 at ``skew = 0``."""
    z = rng.standard_normal(int(n_expert))
    return np.exp(float(skew) * z)


def router_values(ne: tuple[int, ...], skew: float, rng: np.random.Generator, std: float) -> np.ndarray:
    """The f32 values of one router, ne ``[n_embd, n_expert]`` (numpy ``(n_expert, n_embd)``): the scales of
    :func:`router_scales` first, then ``g ~ N(0, std^2)`` row by row from the same ``rng``; row ``e`` is
    ``scale_e * g_e``.

    Raises:
        ValueError: ``ne`` is not 2-D.
    """
    if len(ne) != 2:
        raise ValueError(f"a router is 2-D [n_embd, n_expert], got ne {tuple(ne)}")
    n_embd, n_expert = int(ne[0]), int(ne[1])
    s = router_scales(n_expert, skew, rng).astype(np.float32)
    g = rng.standard_normal((n_expert, n_embd), dtype=np.float32) * np.float32(std)
    return g * s[:, None]


def token_rows(type_id: int, ne: tuple[int, ...], rng: np.random.Generator, rows: int, std: float = 1.0) -> np.ndarray:
    """Bytes of a ``[n_embd, n_vocab]`` tensor (token_embd, output) of type ``type_id`` whose ``min(rows,
    n_vocab)`` distinct random rows (values of std ``std`` where the type is quantized from floats) are
    cycled over the vocabulary (row ``i`` = row ``i mod R``): :func:`strata.testing.blocks.pattern_fill`
    with a pattern of exactly ``R`` whole rows.

    Raises:
        quants.ShapeError: ``n_embd`` not a multiple of the type's block size.
    """
    r = max(1, min(int(rows), int(np.prod(ne[1:]))))
    return pattern_fill(type_id, ne, rng, r * quants.tensor_nbytes(type_id, (int(ne[0]),)), std=std)


def routing_tensor_data(
    routing: TokenRouting, name: str, type_id: int, ne: tuple[int, ...], rng: np.random.Generator, std: float, fill: str
) -> np.ndarray | None:
    """The bytes :class:`TokenRouting` gives tensor ``name`` (``uint8``, whole blocks of ``type_id``), or None
    when it leaves the tensor to the spec's fill: routers (2-D ``blk.N.ffn_gate_inp.weight``) by
    :func:`router_values` encoded as ``type_id`` (:func:`strata.testing.blocks.encode_floats`), and under
    ``fill="pattern"`` ``token_embd`` / ``output`` by :func:`token_rows`.

    Raises:
        ValueError: a router type :func:`~strata.testing.blocks.encode_floats` cannot write (K / IQ quants).
    """
    if name.endswith(ROUTER_SUFFIX) and len(ne) == 2:
        return encode_floats(type_id, router_values(ne, routing.skew, rng, std))
    if fill == "pattern" and name in TOKEN_ROW_TENSORS:
        return token_rows(type_id, ne, rng, routing.embd_rows, routing.embd_std)
    return None


@dataclass(frozen=True)
class PromptSet:
    """Prompts of token ids in topic runs (:func:`topic_prompts`): ``prompts[i]`` (``prompt_len`` ids) is
    drawn from ``topic_tokens[topics[i]]``."""

    prompts: list[list[int]]
    topics: list[int]
    topic_tokens: list[list[int]]

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary: number of prompts, prompt length, topics used, run lengths (in order)."""
        runs: list[int] = []
        for i, t in enumerate(self.topics):
            if i and t == self.topics[i - 1]:
                runs[-1] += 1
            else:
                runs.append(1)
        return {
            "prompts": len(self.prompts),
            "prompt_len": len(self.prompts[0]) if self.prompts else 0,
            "topics_used": sorted(set(self.topics)),
            "runs": runs,
        }


def topic_prompts(
    n_prompts: int,
    prompt_len: int,
    *,
    vocab: int,
    n_topics: int = 8,
    topic_size: int = 32,
    run_length: int = 4,
    seed: int = 0,
    topic_seed: int = 0,
    first_id: int = 0,
) -> PromptSet:
    """``n_prompts`` prompts of ``prompt_len`` token ids with temporal locality, seeded.

    The law: topic ``j`` (``0 <= j < n_topics``) is ``topic_size`` distinct ids drawn without replacement
    from ``range(first_id, vocab)`` by ``default_rng(topic_seed)`` (topics may overlap; they depend only on
    ``topic_seed`` and the sizes, so two sets with different ``seed`` share them: profile on one, hold out
    the other). Prompts come in runs of ``run_length`` prompts of one topic; the first run's topic is
    uniform, each next run's topic uniform among the others (``default_rng([seed, 1])``); a prompt's ids
    are drawn uniformly, with replacement, from its topic.

    Raises:
        ValueError: a count < 1, ``topic_size`` more than the ids in ``range(first_id, vocab)``.
    """
    for k, v in (("n_prompts", n_prompts), ("prompt_len", prompt_len), ("n_topics", n_topics)):
        if v < 1:
            raise ValueError(f"topic_prompts: {k}={v} < 1")
    if run_length < 1 or topic_size < 1:
        raise ValueError(f"topic_prompts: run_length={run_length} and topic_size={topic_size} must be >= 1")
    span = int(vocab) - int(first_id)
    if topic_size > span:
        raise ValueError(f"topic_prompts: topic_size={topic_size} ids from range({first_id}, {vocab}) ({span} ids)")
    trng = np.random.default_rng(int(topic_seed))
    topics = [
        sorted(int(first_id) + int(i) for i in trng.choice(span, topic_size, replace=False)) for _ in range(n_topics)
    ]
    rng = np.random.default_rng([int(seed), 1])
    cur = int(rng.integers(n_topics))
    prompts, which = [], []
    for i in range(n_prompts):
        if i and i % run_length == 0 and n_topics > 1:
            cur = (cur + 1 + int(rng.integers(n_topics - 1))) % n_topics
        ids = rng.choice(np.asarray(topics[cur]), int(prompt_len), replace=True)
        prompts.append([int(x) for x in ids])
        which.append(cur)
    return PromptSet(prompts, which, topics)
