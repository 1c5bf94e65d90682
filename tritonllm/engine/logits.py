"""Operations on a step's logits that every engine shares: the seeded sampling draw, bans and penalties.

Tensor operations of fixed shape without host synchronisation (CUDA graphs capture them), torch only: the
llama.cpp engine applies them to its logit rows on the CPU without importing transformers.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
MIN_TEMPERATURE = 1e-4  # below it, logits / temperature overflows float32; sampling is greedy there anyway
GREEDY = -1  # the seed row of a request that does not sample


def step_seed(seed: int, position: int) -> int:
    """A 31-bit seed for one step of one request (splitmix64 of seed and position)."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 33


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values below 2**32. Its multipliers are below
    2**31, so no product overflows int64 (hash-prospector's two-round xorshift-multiply family)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def uniform(seeds: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in (0, 1), one per (row seed, token id): seeds [B], token_ids [B, V]."""
    keys = _mix32(seeds.long() & _MASK32).unsqueeze(-1)
    bits = _mix32(token_ids.long() ^ keys) >> 8  # 24 bits: what float32 holds exactly
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


# Left out of compilation (EngineConfig.compile): inductor's CUDA code generation fails on the cumulative sum with
# dynamic shapes (torch 2.11), and the sort that dominates this function is one kernel either way.
@torch.compiler.disable
def sample(
    scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """Rows with a seed >= 0 become one-hot (0 at the drawn token, -inf elsewhere); the others are returned as
    they are. scores [B, V] float32; temperature, top_p [B] float32; top_k [B] int (0 = off); seeds [B] int.

    The draw inverts the kept tokens' cumulative distribution at one uniform number per row, so beyond the
    sort it costs a few passes over the scores (under CUDA graphs, for every row of a step that samples)."""
    vocab = scores.size(-1)
    values, order = (scores / temperature.unsqueeze(-1)).sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scores.device).unsqueeze(0)
    keep = rank < torch.where(top_k > 0, top_k, vocab).unsqueeze(-1)
    probs = values.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    # Nucleus: the smallest prefix whose mass reaches top_p, i.e. the tokens whose predecessors' mass is below it.
    keep &= (cdf - probs) < top_p.unsqueeze(-1)
    keep |= rank == 0
    kept = keep.sum(dim=-1, keepdim=True)  # the kept tokens are a prefix of the sorted order
    target = uniform(seeds, torch.zeros_like(kept)) * cdf.gather(1, kept - 1)
    index = (cdf < target).sum(dim=-1, keepdim=True).clamp(max=kept - 1)
    drawn = torch.full_like(scores, float("-inf")).scatter_(1, order.gather(1, index), 0.0)
    return torch.where((seeds >= 0).unsqueeze(-1), drawn, scores)


# Most likely tokens a single row's draw sorts first (draw_one): their top-k costs a small part of sorting 49,152.
# When a nucleus reaches past them (a broad distribution: a raw prompt, a high temperature), a wider prefix is tried
# before the whole row is sorted.
CANDIDATES = 256
WIDER_CANDIDATES = 2048


def draw_one(scores: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int) -> int:
    """The token `sample` draws for one row on the CPU (scores [V] float32, seed >= 0), without sorting the whole
    vocabulary when it can: that sort is most of a draw (~9 ms a row on one core for 49,152 logits).

    The same operations run on the CANDIDATES (or top_k) most likely tokens, widened to every token tied with the
    last one, so that their stable order is the full sort's prefix. The prefix decides the draw when every kept
    token is in it (top_k within it, or a nucleus that the prefix's mass already reaches), or, with the whole
    distribution kept (top_k 0, top_p 1), when the draw falls in the prefix's mass; otherwise, for a nucleus,
    WIDER_CANDIDATES are tried the same way, then `sample` sorts the whole row. The probabilities are normalised
    over the whole row either way, so a draw can differ from `sample`'s only where float rounding moves a boundary
    (tests/unit/engine/test_sampling.py compares them)."""
    temperature = max(temperature, MIN_TEMPERATURE)
    scaled = scores / temperature
    vocab = scaled.numel()
    limit = top_k if 0 < top_k < vocab else vocab
    # A nucleus cut (top_p < 1) is decided in a prefix exactly as `sample` decides it. The whole distribution's
    # draw is not widened: `sample` scales its target by the whole row's summed probability, and the wider prefix's
    # many small steps let that rounding pick another token (1 draw in 120 in the test's broad rows).
    sizes = (
        (max(CANDIDATES, limit),) if limit < vocab else (CANDIDATES, WIDER_CANDIDATES) if top_p < 1 else (CANDIDATES,)
    )
    total = u = None  # the whole row's log normaliser and the draw's uniform: computed once, when a prefix needs them
    for size in sizes:
        if size >= vocab:
            break
        edge = scaled.topk(size).values[-1]
        candidates = (scaled >= edge).nonzero().squeeze(1)  # in index order, as a stable sort breaks ties
        values, order = scaled[candidates].sort(descending=True, stable=True)
        count = values.numel()
        if count >= vocab:
            break
        keep = torch.arange(count) < limit
        if limit <= count:  # every kept token is in the prefix
            probs = values.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        else:
            total = scaled.logsumexp(dim=-1) if total is None else total
            probs = (values - total).exp()
        cdf = probs.cumsum(dim=-1)
        u = float(uniform(torch.tensor([seed]), torch.zeros(1, 1, dtype=torch.long))) if u is None else u
        if limit <= count or float(cdf[-1]) >= top_p:  # no token beyond the prefix is kept
            keep &= (cdf - probs) < top_p
            keep[0] = True
            kept = int(keep.sum())
            index = min(int((cdf < u * cdf[kept - 1]).sum()), kept - 1)
            return int(candidates[order[index]])
        if limit == vocab and top_p >= 1.0 and u < float(cdf[-1]):  # the whole distribution, drawn in the prefix
            return int(candidates[order[int((cdf < u).sum())]])
    row = (torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([seed]))
    return int(sample(scores.unsqueeze(0), *row).argmax(dim=-1))


def ban(scores: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Sets scores[row, id] to -inf for each id >= 0 of banned [B, N]; ids < 0 are empty places."""
    fill = torch.where(banned >= 0, float("-inf"), float("inf")).to(scores.dtype)
    return scores.scatter_reduce(1, banned.clamp(min=0).long(), fill, reduce="amin")


def penalise(
    scores: torch.Tensor,
    count: torch.Tensor,
    repeated: torch.Tensor | None,
    repetition: torch.Tensor | None,
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition (transformers' RepetitionPenaltyLogitsProcessor), then presence and frequency (OpenAI's: logit -=
    presence * [count > 0] + frequency * count) penalties. count: float [B, V] of the generated tokens; repeated:
    bool [B, V], the prompt's and the generated tokens; the penalties [B, 1]. A None penalty is not computed."""
    if repetition is not None:
        # transformers' where(score < 0, score * penalty, score / penalty), without a select on the scores'
        # signs (a branch per element on the CPU): for a penalty >= 1 that is the smaller of the two, else the
        # larger, the same values.
        scaled, divided = scores * repetition, scores / repetition
        penalised = torch.where(repetition >= 1, torch.minimum(scaled, divided), torch.maximum(scaled, divided))
        scores = torch.where(repeated, penalised, scores)
    if presence is not None:
        scores = scores - (frequency * count + presence * (count > 0))
    return scores
