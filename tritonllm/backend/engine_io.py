"""The `tensorrt_llm` model's tensors <-> engine requests, with TensorRT-LLM's names and shapes.

The portable engine answers the same inputs as the `tensorrtllm` backend (input_ids,
input_lengths, request_output_len, end_id, pad_id, stop/bad word lists, runtime_top_k,
runtime_top_p, temperature, seed, streaming, exclude_input_in_output) with the same outputs
(output_ids [batch, beam, tokens], sequence_length [batch, beam]), so either engine drops into
the same ensemble.
"""

from __future__ import annotations

import os

import numpy as np

from tritonllm.engine.api import GenerationRequest, SamplingParams
from tritonllm.errors import InputError
from tritonllm.protocol import MAX_WORD_SEQUENCES
from tritonllm.text.tokenization import Limits, check_sampling, parse_word_list, scalar


def sampling_params(temperature, top_k, top_p, seed) -> SamplingParams:
    """Greedy unless the request asks for randomness: temperature > 0, top_k > 1 or top_p < 1."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0 or top_k == 1:
        return SamplingParams()
    if temperature is None and not top_k and (top_p is None or top_p >= 1):
        return SamplingParams()
    return SamplingParams(
        sample=True,
        temperature=1.0 if temperature is None else float(temperature),
        top_k=int(top_k or 0),
        top_p=1.0 if top_p is None else float(top_p),
        seed=int.from_bytes(os.urandom(8), "little") if seed is None else int(seed),
    )


def _batch_size(arrays: dict[str, np.ndarray]) -> int:
    if "input_ids" not in arrays:
        raise InputError("input_ids", "is required")
    return arrays["input_ids"].shape[0] if arrays["input_ids"].ndim > 1 else 1


def parse_requests(arrays: dict[str, np.ndarray], limits: Limits) -> list[GenerationRequest]:
    """One GenerationRequest per batch row of a `tensorrt_llm` request."""
    batch = _batch_size(arrays)
    ids = arrays["input_ids"].reshape(batch, -1)
    streaming = bool(scalar(arrays, "streaming", 0))
    if streaming and batch > 1:
        raise InputError("streaming", f"streams one sequence per request, got a batch of {batch}")
    requests = []
    for row in range(batch):
        length = scalar(arrays, "input_lengths", row)
        length = ids.shape[1] if length is None else int(length)
        if not 1 <= length <= ids.shape[1]:
            raise InputError(
                "input_lengths", f"must be between 1 and {ids.shape[1]} (the input_ids given), got {length}"
            )
        if length > limits.max_input_len:
            raise InputError("input_ids", f"{length} tokens, over the maximum input length of {limits.max_input_len}")
        prompt = ids[row, :length].tolist()
        if min(prompt) < 0 or max(prompt) >= limits.vocab_size:
            raise InputError("input_ids", f"token ids must be in [0, {limits.vocab_size})")
        output_len = scalar(arrays, "request_output_len", row)
        room = limits.max_seq_len - length
        if output_len is None or not 1 <= output_len <= room:
            raise InputError(
                "request_output_len", f"must be between 1 and {room} for an input of {length} tokens, got {output_len}"
            )
        end_id = scalar(arrays, "end_id", row)
        requests.append(
            GenerationRequest(
                input_ids=prompt,
                max_new_tokens=int(output_len),
                end_id=-1 if end_id is None else int(end_id),
                sampling=sampling_params(
                    scalar(arrays, "temperature", row),
                    scalar(arrays, "runtime_top_k", row),
                    scalar(arrays, "runtime_top_p", row),
                    scalar(arrays, "seed", row),
                ),
                stop_words=_row_words(arrays, "stop_words_list", row, limits),
                bad_words=_row_words(arrays, "bad_words_list", row, limits),
                streaming=streaming,
            )
        )
    return requests


def _row_words(arrays: dict[str, np.ndarray], name: str, row: int, limits: Limits) -> tuple[tuple[int, ...], ...]:
    array = arrays.get(name)
    if array is None:
        return ()
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3 or array.shape[1] != 2:
        raise InputError(name, f"must have shape [batch, 2, length], got {list(array.shape)}")
    words = parse_word_list(array[row % array.shape[0]])
    if len(words) > MAX_WORD_SEQUENCES:
        raise InputError(name, f"{len(words)} words, more than the limit of {MAX_WORD_SEQUENCES}")
    if any(not 0 <= token < limits.vocab_size for word in words for token in word):
        raise InputError(name, f"token ids must be in [0, {limits.vocab_size})")
    return words


def exclude_input(arrays: dict[str, np.ndarray], default: bool) -> bool:
    value = scalar(arrays, "exclude_input_in_output", 0)
    return default if value is None else bool(value)


def pack_outputs(sequences: list[list[int]], pad_id: int) -> dict[str, np.ndarray]:
    """output_ids [batch, 1, longest] padded with `pad_id`, and sequence_length [batch, 1]."""
    width = max((len(s) for s in sequences), default=0)
    output_ids = np.full((len(sequences), 1, max(width, 1)), pad_id, dtype=np.int32)
    for row, seq in enumerate(sequences):
        output_ids[row, 0, : len(seq)] = seq
    lengths = np.asarray([[len(s)] for s in sequences], dtype=np.int32)
    return {"output_ids": output_ids, "sequence_length": lengths}
