"""Streaming text that is right: per-request incremental detokenization and stop strings.

Upstream's streaming ensemble decodes each response's tokens alone in a stateless
postprocessing step, which loses spaces and splits multi-byte characters into U+FFFD. Here each
request keeps its decode state:

- `IncrementalDecoder` decodes a short window of tokens that starts before the new ones (so a
  tokenizer that treats a sequence's first token specially still sees context), emits the text
  the window gained, and holds back a character still waiting for its remaining bytes. Joined,
  its deltas equal `Detokenizer.decode` of all the tokens.
- `StopFilter` cuts the text before the first stop string, even one spanning several tokens,
  and holds back text that could still become a stop string, so the stop text is never emitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from tritonllm.text.detokenization import REPLACEMENT, Detokenizer, stop_index


class IncrementalDecoder:
    def __init__(self, detokenizer: Detokenizer) -> None:
        self.detokenizer = detokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are emitted and need no context
        self._read = 0  # tokens before it are emitted

    def _window_text(self, end: int | None = None) -> str:
        ids = self.ids[self._prefix : end]
        return self.detokenizer.tokenizer.decode(ids, skip_special_tokens=self.detokenizer.skip_special_tokens)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text they complete ("" while a character is unfinished)."""
        self.ids.extend(new_ids)
        if len(self.ids) == self._read:
            return ""
        emitted = self._window_text(self._read)
        text = self._window_text()
        if text.endswith(REPLACEMENT) or len(text) <= len(emitted):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(emitted) :]

    def finish(self) -> str:
        """The text not yet emitted, minus a character that generation cut short."""
        emitted = self._window_text(self._read)
        text = self.detokenizer.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(emitted) :]


class StopFilter:
    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The part of `text` that is certainly not stop text; sets `stopped` at a stop string."""
        if self.stopped:
            return ""
        text = self._held + text
        cut = stop_index(text, self.stops)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._partial_stop_length(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        longest = min(len(text), max((len(s) - 1 for s in self.stops), default=0))
        for size in range(longest, 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0

    def finish(self) -> str:
        held, self._held = ("" if self.stopped else self._held), ""
        return held


class TextStream:
    """Tokens of one request in, text deltas out (never empty while generating), stop strings honoured."""

    def __init__(self, detokenizer: Detokenizer, stops: Sequence[str] = ()) -> None:
        self.decoder = IncrementalDecoder(detokenizer)
        self.filter = StopFilter(stops)

    @property
    def stopped(self) -> bool:
        return self.filter.stopped

    @property
    def num_tokens(self) -> int:
        return len(self.decoder.ids)

    def push(self, new_ids: Sequence[int]) -> str:
        return self.filter.push(self.decoder.push(new_ids))

    def finish(self) -> str:
        if self.filter.stopped:
            return ""
        return self.filter.push(self.decoder.finish()) + self.filter.finish()
