"""Token ids back to text, never ending in a broken character.

A multi-byte UTF-8 character can span several tokens. When generation stops between them
(`max_tokens` reached), `tokenizer.decode` ends the text with U+FFFD. We look at the raw bytes of
the generated tokens: if they end with the start of a character that was never finished, that
replacement character is dropped. Invalid bytes elsewhere are the model's own output and stay.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import numpy as np

from tritonllm.errors import InputError
from tritonllm.protocol import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from tritonllm.text.wire import as_text

REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2's bytes_to_unicode): character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _decoder_kinds(tokenizer) -> set[str]:
    """Names of the fast tokenizer's decoder steps, e.g. {"ByteLevel"} or {"Replace", "ByteFallback", ...}."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps = decoder.get("decoders") or [decoder]
    return {step.get("type", "") for step in steps if step}


def token_bytes_table(tokenizer) -> list[bytes] | None:
    """The raw bytes of every token id (b"" for special tokens), or None for an unknown byte scheme."""
    kinds = _decoder_kinds(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    if "ByteLevel" in kinds:
        byte_of = _gpt2_byte_decoder()

        def to_bytes(piece: str) -> bytes:
            if all(c in byte_of for c in piece):
                return bytes(byte_of[c] for c in piece)
            return piece.encode()  # an added token stored as plain text

    elif "ByteFallback" in kinds:

        def to_bytes(piece: str) -> bytes:
            match = _BYTE_FALLBACK.match(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode()

    else:
        return None
    return [b"" if i in special or piece is None else to_bytes(piece) for i, piece in enumerate(pieces)]


def incomplete_utf8_tail(data: bytes) -> int:
    """Length (0-3) of a trailing sequence that is a valid but unfinished UTF-8 character."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        if need == 1 or back >= need:
            return 0
        try:  # the lead byte and its continuation bytes must be a prefix of some valid character
            data[-back:].decode("utf-8")
        except UnicodeDecodeError as exc:
            return back if exc.reason == "unexpected end of data" else 0
        return 0
    return 0


class Detokenizer:
    """Decodes generated tokens the way the tokenizer does, minus an unfinished last character."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._bytes = token_bytes_table(tokenizer)

    def tail_bytes(self, token_ids: Sequence[int], count: int = 4) -> bytes | None:
        """Raw bytes of the last `count` tokens (enough to see an unfinished character)."""
        if self._bytes is None:
            return None
        table = self._bytes
        return b"".join(table[t] if 0 <= t < len(table) else b"" for t in token_ids[-count:])

    def decode(self, token_ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)
        if not text.endswith(REPLACEMENT):
            return text
        tail = self.tail_bytes(token_ids)
        if tail is None:
            # Unknown byte scheme: a trailing U+FFFD is most likely a character cut short.
            return text.rstrip(REPLACEMENT)
        return text[:-1] if incomplete_utf8_tail(tail) else text

    def decode_batch(self, sequences: Sequence[Sequence[int]]) -> list[str]:
        texts = self.tokenizer.batch_decode([list(s) for s in sequences], skip_special_tokens=self.skip_special_tokens)
        return [self.decode(s) if t.endswith(REPLACEMENT) else t for s, t in zip(sequences, texts, strict=True)]


def finish_reason(stopped: bool, num_tokens: int, max_tokens: int | None) -> str:
    """Why generation ended, inferred: the engine answers only output_ids and sequence_length (NVIDIA's C++ backend
    has no finish-reason output). Neither engine puts the end id in output_ids (TensorRT-LLM's executor leaves it
    out, NVIDIA/TensorRT-LLM issue 2190; the portable engine does the same), so an end before `max_tokens` without
    a stop string is taken as the end id. Nothing else ends these requests early: preprocessing keeps `max_tokens`
    within the sequence limit, a `stop` request cannot name the ensemble's engine request (the bridge gives it no
    request id), and tensorrt_llm_bls answers a cancelled request with an error, not a finish reason."""
    if stopped:
        return FINISH_STOP
    if max_tokens is not None and num_tokens >= max_tokens:
        return FINISH_LENGTH
    return FINISH_EOS


def stop_index(text: str, stops: Sequence[str]) -> int:
    """Where the earliest stop string starts in `text`, or -1."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


def truncate_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the earliest occurrence of any stop string."""
    cut = stop_index(text, stops)
    return text if cut < 0 else text[:cut]


class Postprocessor:
    """TOKENS_BATCH [batch, beam, tokens] + SEQUENCE_LENGTH [batch, beam] -> OUTPUT and FINISH_REASON [batch x beam].

    Optional: STOP_WORDS (the client's strings; the text is cut before the first one),
    REQUEST_OUTPUT_LEN (the client's max_tokens, to tell "length" from "eos"), and INPUT_LENGTH with
    EXCLUDE_INPUT_IN_OUTPUT (false: the tokens start with the prompt's INPUT_LENGTH tokens).
    """

    def __init__(self, detokenizer: Detokenizer) -> None:
        self.detokenizer = detokenizer

    def process(self, requests: Sequence[dict]) -> list:
        results = []
        for arrays in requests:
            try:
                results.append(self._one(arrays))
            except InputError as exc:
                results.append(exc)
        return results

    def _one(self, arrays: dict) -> dict:
        tokens = arrays["TOKENS_BATCH"]
        batch, beams = tokens.shape[0], (tokens.shape[1] if tokens.ndim == 3 else 1)
        tokens = tokens.reshape(batch, beams, -1)
        lengths = arrays["SEQUENCE_LENGTH"].reshape(batch, beams)
        stops = _per_row(arrays.get("STOP_WORDS"), batch, lambda v: as_text(v, "stop_words"))
        max_tokens = _per_row(arrays.get("REQUEST_OUTPUT_LEN"), batch, int)
        exclude = _per_row(arrays.get("EXCLUDE_INPUT_IN_OUTPUT"), batch, bool)
        input_lengths = _per_row(arrays.get("INPUT_LENGTH"), batch, int)
        # With the prompt in the tokens (exclude_input_in_output false), its text leads and is left as it is.
        prompt = [0 if not exclude or exclude[b][0] or not input_lengths else input_lengths[b][0] for b in range(batch)]
        rows = [(b, k) for b in range(batch) for k in range(beams)]
        generated = self.detokenizer.decode_batch([tokens[b, k, prompt[b] : lengths[b, k]].tolist() for b, k in rows])
        prompts = self.detokenizer.decode_batch([tokens[b, k, : prompt[b]].tolist() for b, k in rows])
        outputs, reasons = [], []
        for (b, k), lead, text in zip(rows, prompts, generated, strict=True):
            cut = stop_index(text, stops[b]) if stops else -1
            outputs.append((lead + (text if cut < 0 else text[:cut])).encode())
            limit = max_tokens[b][0] if max_tokens else None
            reasons.append(finish_reason(cut >= 0, int(lengths[b, k]) - prompt[b], limit).encode())
        # One dimension of batch x beams, as NVIDIA's postprocessing answers: its clients read `output[0]` as bytes.
        shape = (batch * beams,)
        return {
            "OUTPUT": np.array(outputs, dtype=object).reshape(shape),
            "FINISH_REASON": np.array(reasons, dtype=object).reshape(shape),
        }


def _per_row(array: np.ndarray | None, batch: int, convert) -> list[list] | None:
    """An optional [batch, n] input as one list per row (a single row applies to all)."""
    if array is None:
        return None
    rows = array.reshape(array.shape[0], -1)
    return [[convert(v) for v in rows[b % rows.shape[0]]] for b in range(batch)]
