"""One request's life in an engine, from its first generated token to its final emission, the same in every engine.

The llama.cpp, transformers and synthetic engines each own their step and their cache; what a sequence does with
the tokens they produce is here: the end id, a stop word or max tokens end it with their finish reason, a streaming
request gets its new tokens as emissions, and the final emission carries the rest with the request's timings. The
engines keep their own locking: these methods are called under it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tritonllm.engine.api import Emission, GenerationRequest, TokenLogProbs, ends_with
from tritonllm.errors import TritonLLMError
from tritonllm.protocol import FINISH_EOS, FINISH_LENGTH, FINISH_STOP


@dataclass(eq=False, kw_only=True)
class Lifecycle:
    request: GenerationRequest
    emit: Callable[[Emission], None]
    tokens: list[int] = field(default_factory=list)  # generated so far, end id excluded
    log_probs: list[TokenLogProbs] = field(default_factory=list)  # one per token of `tokens`, when asked
    sent: int = 0  # tokens already emitted (streaming)
    taken: int = 0  # tokens the engine generated for it, the end id included
    submitted: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None  # when it joined the running batch, where the engine knows it
    first_token: float | None = None  # perf_counter clock
    last_token: float | None = None
    cached: int = 0  # prompt tokens whose KV cache an earlier request left (the prefix cache)
    done: bool = False  # its final emission is made: nothing more is emitted

    def take(self, token: int, log_probs: TokenLogProbs | None = None, now: float | None = None) -> str | None:
        """Takes one generated token (made at `now`, default this instant); returns the finish reason it causes,
        None while the request goes on."""
        now = time.perf_counter() if now is None else now
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.taken += 1
        request = self.request
        if token == request.end_id:
            return FINISH_EOS
        self.tokens.append(token)
        if log_probs is not None:
            self.log_probs.append(log_probs)
        if request.stop_words and any(ends_with(self.tokens, word) for word in request.stop_words):
            return FINISH_STOP
        if len(self.tokens) >= request.max_new_tokens:
            return FINISH_LENGTH
        return None

    def emit_new(self) -> None:
        """A streaming request's tokens since its previous emission."""
        if self.request.streaming and len(self.tokens) > self.sent and not self.done:
            start, self.sent = self.sent, len(self.tokens)
            self.emit(Emission(self.tokens[start:], log_probs=self._log_probs(start)))

    def finish(self, reason: str, error: str | TritonLLMError | None = None) -> bool:
        """The final emission: what was not emitted yet, the finish reason and the timings, and the error with its
        kind. Once: False when the request had already finished."""
        if self.done:
            return False
        self.done = True
        start = self.sent if self.request.streaming else 0
        self.sent = len(self.tokens)
        ttft = tpot = None
        if self.first_token is not None:
            ttft = self.first_token - self.submitted
            if self.taken > 1 and self.last_token is not None:
                tpot = (self.last_token - self.first_token) / (self.taken - 1)
        self.emit(
            Emission(
                self.tokens[start:],
                reason,
                None if error is None else str(error),
                log_probs=self._log_probs(start),
                time_to_first_token=ttft,
                time_per_output_token=tpot,
                time_to_schedule=None if self.scheduled is None else self.scheduled - self.submitted,
                cached_tokens=self.cached,
                error_kind=error.kind if isinstance(error, TritonLLMError) else None,
            )
        )
        return True

    def _log_probs(self, start: int) -> list[TokenLogProbs] | None:
        return self.log_probs[start : len(self.tokens)] if self.request.log_probs >= 0 else None
