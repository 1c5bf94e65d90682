"""Guided decoding with xgrammar (the grammar library TensorRT-LLM uses), as an argument group (sampling.py).

A request's guide is compiled once per distinct (type, text), in `submit`, so that a grammar that does not
compile fails that request alone; a matcher per request then follows its tokens. Before each step the host lets
each guided request's matcher accept the tokens generated since the previous step and fills the request's row
of a token bitmask (vocabulary / 32 int32 words); the step unpacks the bits with tensor operations and sets the
disallowed tokens' logits to -inf. Once the grammar is complete the matcher allows only the stop token, which
is the request's end id, so a guided request ends with FINISH_EOS. A matcher that refuses a generated token (the
request's other controls banned every token its grammar allows: min_tokens its end, say) has lost the request, which
fails with the reason rather than go on unguided.

The host needs every token before it prepares the next step: asynchronous batching, which prepares a step before
the previous one has produced its token, cannot guide (the engine refuses such requests there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch

from tritonllm.engine.api import Guide
from tritonllm.engine.grammar_check import GUIDE_COMPILE_SECONDS, GuideCompiles, not_compiling
from tritonllm.engine.sampling import ArgumentGroup, generated_tokens
from tritonllm.errors import EngineFailure, InputError, TritonLLMError

log = logging.getLogger(__name__)

BITS = [1 << i for i in range(31)] + [-(1 << 31)]  # each bit of an int32 word, as an int32
COMPILED_GUIDES_KEPT = 256  # distinct grammars whose compilation is kept


@dataclass
class Follower:
    """A request's grammar matcher and how many of its generated tokens it has accepted."""

    matcher: object
    min_tokens: int = 0  # the request's, when they ban its end id (the matcher's stop token)
    accepted: int = 0
    # Why it refused a generated token, the engine failing the request with it: the request's own controls (an
    # InputError) or its matcher's failure.
    lost: TritonLLMError | None = None

    def accept(self, token: int, request_id: str) -> bool:
        """Lets the matcher take a generated token; False once it has lost the request."""
        if self.lost is not None:
            return False
        try:
            # A terminated matcher took its stop token; what follows (only stop tokens) is not its to take.
            refused = not self.matcher.is_terminated() and not self.matcher.accept_token(token)
        except Exception as exc:  # this request's matcher: it fails the request, not the step every request shares
            self._failed(exc)
            return False
        if refused:
            self.lost = self._refusal(token)
            log.warning("request %s: %s", request_id, self.lost)
            return False
        self.accepted += 1
        return True

    def _failed(self, exc: Exception) -> None:
        log.exception("a guided request's grammar matcher failed: the request fails alone")
        self.lost = EngineFailure(
            f"internal error: the guide's grammar matcher failed after {self.accepted} tokens: {exc}"
        )

    def _refusal(self, token: int) -> InputError:
        """Why the grammar refused `token`: its mask kept nothing the request's bans left, so the step chose outside
        it (a refused token leaves the matcher as it was)."""
        if self.accepted < self.min_tokens and self.matcher.is_completed():
            return InputError(
                "min_tokens",
                f"is {self.min_tokens}, but the guide's grammar ends after {self.accepted} tokens, where min_tokens "
                "bans the end: lower min_tokens or widen the guide",
            )
        return InputError(
            "guided_decoding_guide",
            f"after {self.accepted} tokens the request's bad words or bias ban every token its grammar allows (token "
            f"{token} came instead)",
        )

    def fill(self, mask: torch.Tensor, row: int) -> None:
        """Row `row` of an int32 token bitmask: the tokens the grammar allows next; once it lost the request, only
        its stop tokens, so that the request ends at once and the engine fails it."""
        matcher = self.matcher
        if self.lost is None:
            try:
                if not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(mask, row)
                    return
            except Exception as exc:
                self._failed(exc)
        # A terminated matcher's request goes on after its stop token; a lost one's is to end: only stop tokens.
        mask[row].zero_()
        for token in matcher.stop_token_ids:
            mask[row, token // 32] |= BITS[token % 32]


class Guides:
    """Compiles guides (cached by type and text) and holds the matcher of each guided request in flight.

    The tokenizer and xgrammar's compiler are loaded at the first guided request: an engine that never meets
    one does not pay for them. Guides compile on GUIDE_COMPILERS threads of their own, and a request waits for its
    guide GUIDE_COMPILE_SECONDS at most (grammar_check.GuideCompiles)."""

    def __init__(self, model_dir: str, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._compiler = None
        self._setup = threading.Lock()
        self._lock = threading.Lock()
        self._compiles = GuideCompiles(self._compile, COMPILED_GUIDES_KEPT, GUIDE_COMPILE_SECONDS)
        self._followers: dict[str, Follower] = {}

    @property
    def compilations(self) -> int:
        """Grammars compiled so far (a repeated one is not compiled again)."""
        return self._compiles.compilations

    def _compiler_ready(self):
        with self._setup:
            if self._compiler is None:
                import xgrammar
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))
            return self._compiler

    def compile(self, guide: Guide):
        """The compiled grammar of `guide`; InputError naming guided_decoding_guide when it does not compile, or
        not within GUIDE_COMPILE_SECONDS."""
        return self._compiles.result(guide.type, "" if guide.type == "json" else guide.text)

    def _compile(self, kind: str, text: str):
        compiler = self._compiler_ready()
        try:
            if kind == "json":
                return compiler.compile_builtin_json_grammar()
            if kind == "json_schema":
                # Compact JSON: a grammar that allows any whitespace lets a model run on in blanks.
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf_grammar":
                return compiler.compile_grammar(text)
        except Exception as exc:
            raise not_compiling(kind, exc) from None
        raise InputError("guided_decoding_guide_type", f"unknown guide type {kind!r}")

    def start(self, request_id: str, compiled, end_id: int, min_tokens: int = 0) -> None:
        """Follows a request's tokens with a matcher of `compiled`; its stop token is the request's end id (the
        tokenizer's end-of-sequence tokens for a request that has none, which min_tokens does not ban)."""
        import xgrammar

        stop = [end_id] if 0 <= end_id < self.vocab_size else None
        matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=stop)
        follower = Follower(matcher, min_tokens if stop is not None else 0)
        with self._lock:
            self._followers[request_id] = follower

    def release(self, request_id: str) -> None:
        with self._lock:
            self._followers.pop(request_id, None)

    def follower(self, request_id: str) -> Follower | None:
        return self._followers.get(request_id)

    def __len__(self) -> int:
        return len(self._followers)


class GuidedDecoding(ArgumentGroup):
    """Masks each guided request's logits with its matcher's token bitmask. Row: whether the request is guided;
    the bitmask rows live in a buffer of their own, a row per logit row."""

    kwargs: ClassVar[dict[str, type]] = {"guided": bool}
    defaults = torch.tensor([[0]], dtype=torch.int32)

    def __init__(self, guides: Guides, max_rows: int, device: torch.device | str) -> None:
        self.guides = guides
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.stream = None  # the manager's compute stream, once it has one
        words = (guides.vocab_size + 31) // 32
        self.host_mask = torch.zeros(max_rows, words, dtype=torch.int32)
        self.mask = self.host_mask if self.device.type == "cpu" else torch.zeros_like(self.host_mask, device=device)
        self.bits = torch.tensor(BITS, dtype=torch.int32, device=device)

    def prepare(self, requests: list) -> torch.Tensor | None:
        columns = []
        for column, future in enumerate(requests):
            if not future.state.logit_processor_kwargs.get("guided"):
                continue
            follower = self.guides.follower(future.state.request_id)
            if follower is None:
                continue
            self._follow(future.state, follower)
            if column >= self.max_rows:
                raise RuntimeError(f"a step of more than {self.max_rows} requests with a new token")
            follower.fill(self.host_mask, column)
            columns.append(column)
        if not columns:
            return None
        rows = max(columns) + 1
        if self.mask is not self.host_mask:
            # On the compute stream: after the step in flight, before the step that reads it.
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                self.mask[:rows].copy_(self.host_mask[:rows])
        args = torch.zeros(1, len(requests), dtype=torch.int32)
        args[0, columns] = 1
        return args

    def _follow(self, state, follower: Follower) -> None:
        """Lets the matcher accept the tokens generated since the last step, until it refuses one."""
        for token in generated_tokens(state)[follower.accepted :]:
            if not follower.accept(token, state.request_id):
                break

    def apply(self, scores: torch.Tensor, args: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        rows, vocab = scores.shape
        allowed = (self.mask[:rows].unsqueeze(-1) & self.bits).ne(0).view(rows, -1)[:, :vocab]
        return scores.masked_fill((args[0] != 0).unsqueeze(-1) & ~allowed, float("-inf"))
