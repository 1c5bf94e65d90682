"""Per-request sampling inside transformers' continuous batching.

transformers' batching manager samples with one global switch (`do_sample`) and one global random
generator, so a request's result would depend on which other requests share its batch, and greedy
requests would pay for sorting the vocabulary. This processor runs with `do_sample=False` (argmax)
and, for the rows of requests that asked for sampling only, draws the token itself with a generator
seeded from the request's seed and position, then leaves that token as the row's only finite score.
Greedy rows are untouched, so greedy output is exactly `generate(do_sample=False)`'s.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)

_MASK64 = (1 << 64) - 1


def _step_seed(seed: int, position: int) -> int:
    """A 63-bit seed for one step of one request (splitmix64 of seed and position)."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> int:
    """Draw one token id from a 1-D row of logits with temperature, top-k and top-p (nucleus) filtering."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.numel():
        scores, ids = torch.topk(scores, top_k)
    else:
        scores, ids = torch.sort(scores, descending=True)
    probs = scores.softmax(-1)
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least the most likely token).
        keep = int(torch.searchsorted(probs.cumsum(-1), torch.tensor([top_p], device=probs.device))) + 1
        probs = probs[:keep]
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(ids[choice])


class SamplingProcessor(ContinuousBatchingLogitsProcessor):
    """Seeded temperature / top-k / top-p sampling for the requests that ask for it.

    Requests pass `sample=True, temperature=, top_k=, top_p=, seed=` as logit-processor kwargs.
    The rows to sample are found on the host when the batch is prepared; this relies on the
    manager calling `prepare_tensor_args` and `__call__` in turn for each batch, which holds
    when CUDA graphs and async batching are off (the engine turns them off).
    """

    supported_kwargs: ClassVar[dict[str, type]] = {
        "sample": bool,
        "temperature": float,
        "top_k": int,
        "top_p": float,
        "seed": int,
    }
    ignored_kwargs: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._rows: list[tuple[int, float, int, float, int]] = []

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_with_new_token: list) -> torch.Tensor:
        self._rows = []
        for row, future in enumerate(requests_with_new_token):
            kwargs = future.state.logit_processor_kwargs
            if kwargs.get("sample"):
                position = future.state.generated_len()
                self._rows.append(
                    (row, kwargs["temperature"], kwargs["top_k"], kwargs["top_p"], _step_seed(kwargs["seed"], position))
                )
        flags = torch.zeros(len(requests_with_new_token), dtype=torch.int32)
        flags[[r[0] for r in self._rows]] = 1
        return flags

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return scores
        generator = torch.Generator(device=scores.device)
        for row, temperature, top_k, top_p, seed in self._rows:
            generator.manual_seed(seed)
            token = sample_row(scores[row], temperature, top_k, top_p, generator)
            scores[row].fill_(float("-inf"))
            scores[row, token] = 0.0
        return scores
