"""The request's tensor wire format, and the range checks every entry point applies to it.

How a request's scalars, text and stop/bad word lists travel in NVIDIA's tensors, and the rules its controls
obey whichever model reads them (preprocessing, the engine model, tensorrt_llm_bls) and whichever engine serves
them: each is written once, here, and its error names the input the client sent.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tritonllm.engine.checks import check_guide_fields
from tritonllm.errors import InputError


@dataclass(frozen=True)
class Limits:
    max_input_len: int  # prompt tokens
    max_seq_len: int  # prompt + generated tokens
    vocab_size: int


def as_text(value: object, field: str) -> str:
    """A BYTES tensor element as str; invalid UTF-8 is a client error."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(field, f"is not valid UTF-8 (byte {exc.start})") from None
    if isinstance(value, str):
        return value
    raise InputError(field, f"must be text, got {type(value).__name__}")


def scalar(arrays: dict[str, np.ndarray], name: str, row: int):
    """Element `row` of an optional per-row input, or None when the input is absent."""
    array = arrays.get(name)
    if array is None:
        return None
    flat = array.reshape(array.shape[0], -1) if array.ndim > 1 else array.reshape(-1, 1)
    if flat.shape[1] != 1:
        raise InputError(name, f"must hold one value per request, got shape {list(array.shape)}")
    value = flat[row % flat.shape[0], 0]
    return value.item() if isinstance(value, np.generic) else value  # BYTES elements are bytes already


def parse_guide(kind: object, guide: object) -> tuple[str, str] | None:
    """(guide type, guide) of guided_decoding_guide_type / guided_decoding_guide, or None when not asked for."""
    kind = None if kind is None else as_text(kind, "guided_decoding_guide_type")
    text = "" if guide is None else as_text(guide, "guided_decoding_guide")
    check_guide_fields(kind, text)
    return None if kind is None else (kind, text)


def check_beam_width(beam_width, max_beam_width: int) -> None:
    if beam_width is not None and not 1 <= beam_width <= max_beam_width:
        raise InputError(
            "beam_width", f"must be between 1 and {max_beam_width} (the engine's max_beam_width), got {beam_width}"
        )


def word_list(sequences: Sequence[Sequence[int]]) -> np.ndarray:
    """TensorRT-LLM's [2, L] word-list format: flattened ids, then cumulative end offsets padded with -1."""
    flat = [t for seq in sequences for t in seq]
    offsets = list(itertools.accumulate(len(seq) for seq in sequences))  # np.cumsum of a list: ~10x as long
    width = max(len(flat), len(offsets), 1)
    out = np.zeros((2, width), dtype=np.int32)
    out[1, :] = -1
    out[0, : len(flat)] = flat
    out[1, : len(offsets)] = offsets
    return out


def parse_word_list(array: np.ndarray | None) -> tuple[tuple[int, ...], ...]:
    """Inverse of `word_list` for one request ([2, L] or [1, 2, L])."""
    if array is None or array.size == 0:
        return ()
    array = array.reshape(2, -1)
    flat, offsets = array[0].tolist(), [o for o in array[1].tolist() if o >= 0]
    words, start = [], 0
    for end in offsets:
        if end > start:
            words.append(tuple(flat[start:end]))
        start = end
    return tuple(words)


def log_probs_wanted(arrays: dict[str, np.ndarray], row: int) -> int:
    """-1: none; 0: the chosen tokens'; k: also the k most likely (num_top_log_probs, which implies them)."""
    top = scalar(arrays, "num_top_log_probs", row)
    if top is not None and top < 0:  # -1 is the engine's "none", not a client's value
        raise InputError("num_top_log_probs", f"must be >= 0, got {top}")
    if top:
        return int(top)
    return 0 if scalar(arrays, "return_log_probs", row) else -1
