"""Operations on a step's logits that every engine shares: the seeded sampling draw and bans (penalties:
tritonllm/engine/penalties.py).

Tensor operations of fixed shape without host synchronisation (CUDA graphs capture them), in torch, for the
transformers engine's batch; the llama.cpp engine's rows take the same rules in numpy (tritonllm/engine/row_draw.py,
row_controls.py).
"""

from __future__ import annotations

import torch

_MASK32 = (1 << 32) - 1
GREEDY = -1  # the seed row of a request that does not sample


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """row_draw.mix32 on int64 tensors holding values below 2**32. Its multipliers are below 2**31, so no product
    overflows int64."""
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


def ban(scores: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Sets scores[row, id] to -inf for each id >= 0 of banned [B, N]; ids < 0 are empty places."""
    fill = torch.where(banned >= 0, float("-inf"), float("inf")).to(scores.dtype)
    return scores.scatter_reduce(1, banned.clamp(min=0).long(), fill, reduce="amin")
