"""One request's generation controls applied to its own logit row on the CPU, in numpy, for the llama.cpp engine.

The transformers engine runs the controls as argument groups inside its batched step in torch
(tritonllm/engine/sampling.py, controls.py, guided.py); llama.cpp hands each step's logits to the host, where a
request that uses a control gets its row processed alone, by the same rules and in the same order: log probabilities
of the raw logits, embedding bias, penalties (tritonllm/engine/penalties.py, shared), bans (bad words, the end id
before min_tokens), the grammar's mask, then the seeded draw (row_draw.draw_request, `sample`'s draw without sorting
the whole row). A request without controls never comes here: its token is the row's argmax. numpy, not torch: the
engine's process loads torch (~300 MiB) only for a guided request, whose grammar matcher fills a torch bitmask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tritonllm.engine.api import GenerationRequest, TokenLogProbs, ends_with
from tritonllm.engine.penalties import penalise
from tritonllm.engine.row_draw import draw_request
from tritonllm.protocol import MAX_TOP_LOG_PROBS

if TYPE_CHECKING:
    from tritonllm.engine.guided import Follower


class RowControls:
    """A request's control state: its bias, its token counts, its sampling parameters, its grammar."""

    def __init__(self, request: GenerationRequest, vocab_size: int, follower: Follower | None, request_id: str):
        self.request = request
        self.request_id = request_id
        self.follower = follower
        self.vocab_size = vocab_size
        self.bias_ids = self.bias_values = None
        if request.embedding_bias:
            ids, values = zip(*request.embedding_bias, strict=True)
            self.bias_ids, self.bias_values = np.array(ids), np.array(values, np.float32)
        penalties = request.penalties
        self.counts = self.prompt = self.repetition = self.presence = self.frequency = None
        if penalties.repetition != 1.0 or penalties.presence or penalties.frequency:
            self.counts = np.zeros(vocab_size, np.float32)
            prompt = np.clip(np.asarray(request.input_ids, np.int64), 0, vocab_size - 1)
        if penalties.repetition != 1.0:
            self.repetition = np.float32(penalties.repetition)
            self.prompt = np.zeros(vocab_size, bool)
            self.prompt[prompt] = True
        if penalties.presence or penalties.frequency:
            self.presence, self.frequency = np.float32(penalties.presence), np.float32(penalties.frequency)
            if penalties.count_prompt:
                self.counts += np.bincount(prompt, minlength=vocab_size).astype(np.float32)
        self.mask = None
        if follower is not None:  # xgrammar fills a torch tensor; torch is loaded with the guides (guided.py)
            import torch

            self.mask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self._longest_word = max((len(w) for w in request.bad_words), default=0)

    def choose(self, row: np.ndarray, generated: Sequence[int]) -> tuple[int, TokenLogProbs | None]:
        """The next token from the model's logit row (float32 [vocab]) and, when asked, its log probabilities;
        `generated`: the request's tokens so far. The row is not modified."""
        request = self.request
        scores = row[: self.vocab_size]
        log_probs = _log_softmax(scores) if request.log_probs >= 0 else None
        if self.bias_ids is not None:
            scores = scores.copy()
            np.add.at(scores, self.bias_ids, self.bias_values)  # a token listed twice gets both values
        if self.counts is not None:
            repeated = (self.counts > 0) | self.prompt if self.prompt is not None else None
            scores = penalise(scores, self.counts, repeated, self.repetition, self.presence, self.frequency, np)
        banned = self._banned(generated)
        guided = self.follower is not None and not self.follower.lost
        if (banned or guided) and self.bias_ids is None and self.counts is None:  # still the row itself
            scores = scores.copy()
        scores[banned] = -np.inf
        if guided:
            self.follower.fill(self.mask, 0)
            allowed = np.unpackbits(self.mask.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
            scores[allowed == 0] = -np.inf
        if request.sampling.sample:
            token = draw_request(scores, request.sampling, len(request.input_ids) + len(generated))
        else:
            token = int(scores.argmax())
        self._accept(token)
        chosen = None
        if log_probs is not None:
            top = ()
            if request.log_probs > 0:
                count = min(request.log_probs, MAX_TOP_LOG_PROBS, self.vocab_size)
                ids = np.argpartition(-log_probs, count - 1)[:count]
                ids = ids[np.argsort(-log_probs[ids], kind="stable")]  # most likely first
                top = tuple(zip(ids.tolist(), log_probs[ids].tolist(), strict=True))
            chosen = TokenLogProbs(float(log_probs[token]), top)
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
            self.counts[token] += 1
        if self.follower is not None:
            self.follower.accept(token, self.request_id)


def _log_softmax(scores: np.ndarray) -> np.ndarray:
    """torch's log_softmax of a float32 row: shifted by its maximum, the normaliser summed in float32."""
    shifted = scores - scores.max()
    return shifted - np.log(np.exp(shifted).sum(dtype=np.float32))
