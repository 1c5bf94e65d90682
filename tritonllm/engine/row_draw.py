"""One logit row's seeded sampling draw on the CPU, in numpy: what `logits.sample` draws for that row.

The llama.cpp engine draws each sampling request's token on the host between steps, one row at a time. torch's
per-call overhead and its sorts made that 0.7-0.9 ms a row (49,152 logits, one core of the 2-core host): at 16
sampled streams a tenth of every step. Here it is one pass to scale the row, one to find the tokens near its peak,
and, without top_k, one exp over the row for its normaliser: 0.19-0.25 ms for the model's rows at temperature 0.7,
top-p 0.95. No torch: a request that only samples (and biases) never needs it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from tritonllm.engine.api import SamplingParams

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
MIN_TEMPERATURE = 1e-4  # below it, logits / temperature overflows float32; sampling is greedy there anyway

# How far below the row's peak (in logits after the temperature) the sorted prefix reaches, rung by rung: a token 6
# below the peak is 0.25 % as likely as the peak's, so the first rung (a few dozen tokens of the model's rows) holds
# a usual nucleus; a broad row (a raw prompt, a high temperature) needs the second (6e-6), and what neither decides
# sorts the whole row.
REACHES = (6.0, 12.0)


def step_seed(seed: int, position: int) -> int:
    """A 31-bit seed for one step of one request (splitmix64 of seed and position)."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 33


def mix32(x: int) -> int:
    """A 32-bit integer hash (hash-prospector's two-round xorshift-multiply family); `logits.uniform` runs the same
    on tensors."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _MASK32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def row_uniform(seed: int) -> np.float32:
    """The uniform number in (0, 1) that `logits.sample` draws a row with: `uniform(seed, token id 0)`."""
    bits = mix32(mix32(seed & _MASK32)) >> 8  # 24 bits: what float32 holds exactly
    return (np.float32(bits) + np.float32(0.5)) * np.float32(1.0 / (1 << 24))


def draw_one(scores: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int) -> int:
    """The token `logits.sample` draws for one row (scores float32 [V], seed >= 0), sorting only the tokens near the
    row's peak when they decide it.

    Those tokens are a prefix of `sample`'s stable descending order (every token tied with the last is in). A prefix
    decides the draw when every kept token is in it (top_k within it, or a nucleus whose mass it already holds), or,
    with the whole distribution kept, when the draw falls in its mass. The probabilities are normalised as
    `sample`'s: over the top_k kept tokens, else over the whole row. A draw can differ from `sample`'s only where
    float rounding moves a boundary (tests/unit/engine/test_sampling.py compares them): on the CPU torch's softmax
    sums to 1 within ~1e-5, which moves about 1 whole-distribution draw in 20 of the model's rows to a neighbouring
    token of nearly the same probability."""
    scaled = scores / np.float32(max(temperature, MIN_TEMPERATURE))
    peak = scaled.max()
    if np.isnan(peak):  # a broken row: its NaN tokens are never drawn, and no prefix comes out empty
        scaled = np.where(np.isnan(scaled), np.float32(-np.inf), scaled)
        peak = scaled.max()
    if 0 < top_k < scaled.size:
        return _draw_top_k(scaled, peak, top_k, np.float32(top_p), row_uniform(seed))
    return _draw_whole(scaled, peak, np.float32(top_p), row_uniform(seed))


def draw_request(scores: np.ndarray, sampling: SamplingParams, position: int) -> int:
    """`draw_one` with a sampling request's parameters, seeded for its step at `position` (prompt + generated)."""
    top_k = min(sampling.top_k, 2**31 - 1)
    return draw_one(scores, sampling.temperature, top_k, sampling.top_p, step_seed(sampling.seed, position))


def _near_peak(scaled: np.ndarray, peak: np.float32, at_least: int) -> Iterator[np.ndarray]:
    """The ids within each reach of the peak, nearest first, that hold at least `at_least` tokens and not all."""
    for reach in REACHES:
        candidates = np.flatnonzero(scaled >= peak - np.float32(reach))
        if at_least <= candidates.size < scaled.size:
            yield candidates


def _pick(cdf: np.ndarray, probs: np.ndarray, top_p: np.float32, u: np.float32) -> int:
    """`sample`'s draw in a sorted prefix that holds every kept token: the nucleus, then the uniform's place in it."""
    kept = (cdf - probs) < top_p
    kept[0] = True
    last = int(kept.sum()) - 1
    return min(int((cdf < u * cdf[last]).sum()), last)


def _draw_top_k(scaled: np.ndarray, peak: np.float32, top_k: int, top_p: np.float32, u: np.float32) -> int:
    candidates = next(_near_peak(scaled, peak, top_k), None)
    if candidates is None:  # a broad row: the top_k's edge, found without sorting
        candidates = np.flatnonzero(scaled >= np.partition(scaled, scaled.size - top_k)[scaled.size - top_k])
    order = np.argsort(-scaled[candidates], kind="stable")  # ties in index order, as a stable sort keeps them
    values = scaled[candidates[order[:top_k]]]
    probs = np.exp(values - values[0])
    probs /= probs.sum(dtype=np.float32)
    cdf = np.cumsum(probs, dtype=np.float64).astype(np.float32)  # as torch's CPU cumsum accumulates
    return int(candidates[order[_pick(cdf, probs, top_p, u)]])


def _draw_whole(scaled: np.ndarray, peak: np.float32, top_p: np.float32, u: np.float32) -> int:
    weights = np.exp(scaled - peak)
    total = weights.sum(dtype=np.float32)
    for ids in itertools.chain(_near_peak(scaled, peak, 1), [np.arange(scaled.size)]):
        order = np.argsort(-scaled[ids], kind="stable")
        probs = weights[ids[order]] / total
        cdf = np.cumsum(probs, dtype=np.float64).astype(np.float32)
        if (top_p < 1 and cdf[-1] >= top_p) or ids.size == scaled.size:  # every kept token is here
            return int(ids[order[_pick(cdf, probs, top_p, u)]])
        if top_p >= 1 and cdf[-1] >= u:  # the whole distribution, drawn in this prefix's mass
            return int(ids[order[int((cdf < u).sum())]])
    raise AssertionError("the whole row decides every draw")
