"""One request's generation controls applied to its own logit row on the CPU, for the llama.cpp engine.

The portable engine runs the controls as argument groups inside transformers' batched step
(tritonllm/engine/sampling.py, controls.py, guided.py); llama.cpp hands each step's logits to the host, where a
request that uses a control gets its row processed alone, with the same tensor operations (tritonllm/engine/logits.py)
and in the same order: log probabilities of the raw logits, embedding bias, penalties, bans (bad words, the end id
before min_tokens), the grammar's mask, then the seeded draw (row_draw.draw_one: `sample`'s draw, without sorting the
whole row). A request without controls never comes here: its token is the row's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tritonllm.engine.api import GenerationRequest, TokenLogProbs, ends_with
from tritonllm.engine.guided import Follower
from tritonllm.engine.logits import penalise
from tritonllm.engine.row_draw import draw_request
from tritonllm.protocol import MAX_TOP_LOG_PROBS


class RowControls:
    """A request's control state: its dense bias row, its token counts, its sampling parameters, its grammar."""

    def __init__(self, request: GenerationRequest, vocab_size: int, follower: Follower | None, request_id: str):
        self.request = request
        self.request_id = request_id
        self.follower = follower
        self.vocab_size = vocab_size
        self.bias = None
        if request.embedding_bias:
            ids, values = zip(*request.embedding_bias, strict=True)
            self.bias = (
                torch.zeros(vocab_size)
                .index_put_(
                    (torch.tensor(ids, dtype=torch.long),),
                    torch.tensor(values, dtype=torch.float32),
                    accumulate=True,  # a token listed twice gets both values, as a dense bias tensor would sum them
                )
                .unsqueeze(0)
            )
        penalties = request.penalties
        self.counts = self.prompt = self.repetition = self.presence = self.frequency = None
        if penalties.repetition != 1.0 or penalties.presence or penalties.frequency:
            self.counts = torch.zeros(1, vocab_size)
            prompt = torch.tensor(request.input_ids, dtype=torch.long).clamp(0, vocab_size - 1)
        if penalties.repetition != 1.0:
            self.repetition = torch.tensor([[penalties.repetition]])
            self.prompt = torch.zeros(1, vocab_size, dtype=torch.bool)
            self.prompt[0, prompt] = True
        if penalties.presence or penalties.frequency:
            self.presence, self.frequency = torch.tensor([[penalties.presence]]), torch.tensor([[penalties.frequency]])
            if penalties.count_prompt:
                self.counts[0] += torch.bincount(prompt, minlength=vocab_size)
        self.mask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32) if follower is not None else None
        self._longest_word = max((len(w) for w in request.bad_words), default=0)

    def choose(self, row: np.ndarray, generated: Sequence[int]) -> tuple[int, TokenLogProbs | None]:
        """The next token from the model's logit row (float32 [vocab]) and, when asked, its log probabilities;
        `generated`: the request's tokens so far. The row is not modified.

        torch serves one row here, between llama.cpp's steps, on one thread: a thread team of its own would only
        contend with llama.cpp's for the cores. The count is set for the call and restored (a fraction of a
        microsecond), not for the process, where a transformers engine may run too (the tests do)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._choose(row, generated)
        finally:
            torch.set_num_threads(threads)

    def _choose(self, row: np.ndarray, generated: Sequence[int]) -> tuple[int, TokenLogProbs | None]:
        request = self.request
        scores = torch.from_numpy(row[: self.vocab_size]).unsqueeze(0)
        log_probs = scores.log_softmax(dim=-1) if request.log_probs >= 0 else None
        if self.bias is not None:
            scores = scores + self.bias
        if self.counts is not None:
            repeated = (self.counts > 0) | self.prompt if self.prompt is not None else None
            scores = penalise(scores, self.counts, repeated, self.repetition, self.presence, self.frequency)
        banned = self._banned(generated)
        if banned:
            scores = scores.index_fill(1, torch.tensor(banned, dtype=torch.long), float("-inf"))
        if self.follower is not None and not self.follower.lost:
            import xgrammar

            self.follower.fill(self.mask, 0)
            scores = scores.clone() if scores.data_ptr() == row.ctypes.data else scores
            xgrammar.apply_token_bitmask_inplace(scores, self.mask)
        if request.sampling.sample:
            token = draw_request(scores[0].numpy(), request.sampling, len(request.input_ids) + len(generated))
        else:
            token = int(scores.argmax(dim=-1))
        self._accept(token)
        chosen = None
        if log_probs is not None:
            top = ()
            if request.log_probs > 0:
                values, ids = log_probs[0].topk(min(request.log_probs, MAX_TOP_LOG_PROBS))
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
            chosen = TokenLogProbs(float(log_probs[0, token]), top)
        return token, chosen

    def _banned(self, generated: Sequence[int]) -> list[int]:
        """Bad words' last tokens whose other tokens end the sequence, and the end id before min_tokens."""
        request = self.request
        banned = []
        if self._longest_word:
            before = self._tail(generated, self._longest_word - 1)
            banned = [word[-1] for word in request.bad_words if ends_with(before, word[:-1])]
        if len(generated) < request.penalties.min_tokens and 0 <= request.end_id < self.vocab_size:
            banned.append(request.end_id)
        return banned

    def _tail(self, generated: Sequence[int], count: int) -> list[int]:
        """The last `count` tokens of the prompt and the generated tokens, without joining the two."""
        if count <= 0:
            return []
        own = list(generated[-count:])
        missing = count - len(own)
        return (list(self.request.input_ids[-missing:]) if missing > 0 else []) + own

    def _accept(self, token: int) -> None:
        if self.counts is not None and 0 <= token < self.vocab_size:
            self.counts[0, token] += 1
        if self.follower is not None:
            self.follower.accept(token, self.request_id)
