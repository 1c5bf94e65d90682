"""The `tensorrt_llm` model's tensors <-> engine requests, with TensorRT-LLM's names and shapes.

The portable engine answers the same inputs as the `tensorrtllm` backend (model_repository/_shared/
tensorrt_llm_io.pbtxt) with the same outputs (output_ids [batch, beam, tokens], sequence_length
[batch, beam], and when asked log probs and token counts), so either engine drops into the same ensemble.
It generates one beam: beam_width above 1 is refused, and len_penalty, which only scores beams, changes
nothing, as in TensorRT-LLM with one beam.
"""

from __future__ import annotations

import math
import os

import numpy as np

from tritonllm.engine.api import GenerationRequest, Guide, Penalties, SamplingParams, TokenLogProbs
from tritonllm.errors import InputError
from tritonllm.protocol import KV_CACHE_OUTPUTS, MAX_TOP_LOG_PROBS, MAX_WORD_SEQUENCES
from tritonllm.text.tokenization import Limits, check_sampling, parse_guide, parse_word_list, scalar


def sampling_params(temperature, top_k, top_p, seed) -> SamplingParams:
    """Greedy unless the request asks for randomness: temperature > 0, top_k > 1 or top_p < 1. A runtime_top_p
    of 0 or less is unset, as TensorRT-LLM's backend reads it (NVIDIA's inflight_batcher_llm_client sends 0)."""
    if top_p is not None and top_p <= 0:
        top_p = None
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
                penalties=penalties(arrays, row),
                embedding_bias=_embedding_bias(arrays, row, limits),
                log_probs=log_probs_wanted(arrays, row),
                guide=guide(arrays, row),
            )
        )
    return requests


def penalties(arrays: dict[str, np.ndarray], row: int) -> Penalties:
    beam_width = scalar(arrays, "beam_width", row)
    if beam_width is not None and beam_width != 1:
        raise InputError("beam_width", f"the portable engine generates one beam: it must be 1, got {beam_width}")
    repetition = scalar(arrays, "repetition_penalty", row)
    if repetition is not None and not (math.isfinite(repetition) and repetition > 0):
        raise InputError("repetition_penalty", f"must be a finite number > 0 (1 = none), got {repetition}")
    values = {"repetition": 1.0 if repetition is None else float(repetition)}
    for name, key in (("presence_penalty", "presence"), ("frequency_penalty", "frequency")):
        value = scalar(arrays, name, row)
        if value is not None and not math.isfinite(value):
            raise InputError(name, f"must be a finite number (0 = none), got {value}")
        values[key] = 0.0 if value is None else float(value)
    min_tokens = scalar(arrays, "min_tokens", row)
    if min_tokens is not None and min_tokens < 0:
        raise InputError("min_tokens", f"must be >= 0, got {min_tokens}")
    return Penalties(**values, min_tokens=int(min_tokens or 0))


def _embedding_bias(arrays: dict[str, np.ndarray], row: int, limits: Limits) -> tuple[tuple[int, float], ...]:
    """TensorRT-LLM's dense [vocab] embedding_bias as the engine's sparse (token, bias) pairs; empty = none."""
    array = arrays.get("embedding_bias")
    if array is None or array.size == 0:
        return ()
    rows = array.reshape(array.shape[0], -1)
    bias = rows[row % rows.shape[0]]
    if bias.shape[0] != limits.vocab_size:
        raise InputError(
            "embedding_bias", f"must hold {limits.vocab_size} values (the vocabulary), got {bias.shape[0]}"
        )
    if np.isnan(bias).any() or np.isposinf(bias).any():
        raise InputError("embedding_bias", "must hold finite numbers or -inf (a ban)")
    tokens = np.flatnonzero(bias)
    return tuple(zip(tokens.tolist(), bias[tokens].tolist(), strict=True))


def log_probs_wanted(arrays: dict[str, np.ndarray], row: int) -> int:
    """-1: none; 0: the chosen tokens'; k: also the k most likely (num_top_log_probs, which implies them)."""
    top = scalar(arrays, "num_top_log_probs", row)
    if top is not None and not 0 <= top <= MAX_TOP_LOG_PROBS:
        raise InputError("num_top_log_probs", f"must be between 0 and {MAX_TOP_LOG_PROBS}, got {top}")
    if top:
        return int(top)
    return 0 if scalar(arrays, "return_log_probs", row) else -1


def guide(arrays: dict[str, np.ndarray], row: int) -> Guide | None:
    parsed = parse_guide(
        scalar(arrays, "guided_decoding_guide_type", row), scalar(arrays, "guided_decoding_guide", row)
    )
    return None if parsed is None else Guide(*parsed)


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


def pack_outputs(
    sequences: list[list[int]],
    pad_id: int,
    log_probs: list[list[TokenLogProbs] | None] | None = None,
    top: int = 0,
) -> dict[str, np.ndarray]:
    """output_ids [batch, 1, longest] padded with `pad_id` and sequence_length [batch, 1]; with `log_probs` (one
    list per row, of its generated tokens), output_log_probs [batch, 1, longest] and cum_log_probs [batch, 1], and
    with `top` > 0, top_log_probs / top_log_prob_ids [batch, 1, longest, top]."""
    width = max((len(s) for s in sequences), default=0)
    output_ids = np.full((len(sequences), 1, max(width, 1)), pad_id, dtype=np.int32)
    for row, seq in enumerate(sequences):
        output_ids[row, 0, : len(seq)] = seq
    lengths = np.asarray([[len(s)] for s in sequences], dtype=np.int32)
    outputs = {"output_ids": output_ids, "sequence_length": lengths}
    if log_probs is None:
        return outputs
    rows = [entries or [] for entries in log_probs]
    longest = max(1, *(len(r) for r in rows))
    chosen = np.zeros((len(rows), 1, longest), dtype=np.float32)
    top_values = np.full((len(rows), 1, longest, max(top, 1)), -np.inf, dtype=np.float32)
    top_ids = np.full((len(rows), 1, longest, max(top, 1)), pad_id, dtype=np.int32)
    for row, entries in enumerate(rows):
        chosen[row, 0, : len(entries)] = [e.log_prob for e in entries]
        for position, entry in enumerate(entries):
            for rank, (token, value) in enumerate(entry.top[:top]):
                top_ids[row, 0, position, rank], top_values[row, 0, position, rank] = token, value
    outputs["output_log_probs"] = chosen
    outputs["cum_log_probs"] = chosen.sum(axis=-1)
    if top:
        outputs["top_log_probs"], outputs["top_log_prob_ids"] = top_values, top_ids
    return outputs


def kv_cache_outputs(input_tokens: list[int], generated: list[int], cached: list[int]) -> dict[str, np.ndarray]:
    """TensorRT-LLM's per-request KV cache counts (KV_CACHE_OUTPUTS: new, reused, total), one row per request.

    The portable engine's blocks are one token each: a request holds its prompt's cells and one per generated
    token but the last (never fed back); `cached` of them were an earlier request's (the prefix cache)."""
    total = [prompt + max(made - 1, 0) for prompt, made in zip(input_tokens, generated, strict=True)]
    new = [t - c for t, c in zip(total, cached, strict=True)]
    return {
        name: np.asarray(values, dtype=np.int32).reshape(-1, 1)
        for name, values in zip(KV_CACHE_OUTPUTS, (new, cached, total), strict=True)
    }
