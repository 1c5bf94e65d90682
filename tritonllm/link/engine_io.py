"""The `tensorrt_llm` model's tensors <-> engine requests, with TensorRT-LLM's names and shapes.

The portable engine answers the same inputs as the `tensorrtllm` backend (model_repository/_shared/
tensorrt_llm_io.pbtxt) with the same outputs (output_ids [batch, beam, tokens], sequence_length
[batch, beam], and when asked log probs and token counts), so either engine drops into the same ensemble.
It generates one beam: beam_width above 1 is refused, and len_penalty, which only scores beams, changes
nothing, as in TensorRT-LLM with one beam.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tritonllm.engine.adapters import AdapterTable
from tritonllm.engine.api import Emission, GenerationRequest, Guide, Penalties, SamplingParams, TokenLogProbs
from tritonllm.engine.checks import check_controls, check_penalties, check_sampling
from tritonllm.errors import InputError
from tritonllm.protocol import (
    DEFAULT_MIN_TOKENS,
    KV_CACHE_OUTPUTS,
    MAX_RETURN_SEQUENCES,
    MAX_WORD_SEQUENCES,
    PERF_OUTPUTS,
    TIMING_OUTPUTS,
)
from tritonllm.text.wire import Limits, as_text, log_probs_wanted, parse_guide, parse_word_list, scalar


def sampling_params(temperature, top_k, top_p, seed) -> SamplingParams:
    """TensorRT-LLM's rule (its sampling kernel turns top_k 0 with top_p 0 into top_k 1): greedy unless the request
    asks for a cut that keeps more than one token, top_k > 1 or top_p in (0, 1]; then `temperature` (1 when
    absent) scales the logits, and 0 is greedy. A runtime_top_p of 0 or less is unset, as TensorRT-LLM's backend
    reads it (NVIDIA's inflight_batcher_llm_client sends 0). A temperature alone is greedy, as there."""
    if top_p is not None and top_p <= 0:
        top_p = None
    check_sampling(temperature, top_k, top_p)
    if temperature == 0 or not ((top_k or 0) > 1 or top_p is not None):
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


class IndexedRequest(NamedTuple):
    """An engine request of a `tensorrt_llm` request: its batch row and, of num_return_sequences, which one."""

    request: GenerationRequest
    batch_index: int
    sequence_index: int


def parse_requests(
    arrays: dict[str, np.ndarray], limits: Limits, adapters: AdapterTable | None = None
) -> list[IndexedRequest]:
    """The engine requests of a `tensorrt_llm` request: num_return_sequences (1 unless given) per batch row,
    each sampled one with the row's seed plus its index, so the sequences differ as TensorRT-LLM's do. `adapters`:
    the LoRA adapters `lora_name` and `lora_task_id` may choose (none when not given)."""
    adapters = adapters or AdapterTable()
    batch = _batch_size(arrays)
    ids = arrays["input_ids"].reshape(batch, -1)
    streaming = bool(scalar(arrays, "streaming", 0))
    decoder = arrays.get("decoder_input_ids")
    if decoder is not None and decoder.reshape(batch, -1).shape[1] > 1:
        raise InputError(
            "decoder_input_ids",
            "is an encoder-decoder model's decoder prompt; this engine runs decoder-only models, and takes only "
            "the one-token placeholder NVIDIA's preprocessing sends for them",
        )
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
        request = GenerationRequest(
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
            adapter=adapter(arrays, row, adapters),
        )
        check_controls(request, limits.vocab_size)
        for index in range(return_sequences(arrays, row)):
            seed = (request.sampling.seed + index) % 2**64
            sampling = dataclasses.replace(request.sampling, seed=seed) if request.sampling.sample else request.sampling
            requests.append(IndexedRequest(dataclasses.replace(request, sampling=sampling), row, index))
    return requests


def return_sequences(arrays: dict[str, np.ndarray], row: int) -> int:
    """num_return_sequences: 1 when absent (TensorRT-LLM's default), at most MAX_RETURN_SEQUENCES."""
    count = scalar(arrays, "num_return_sequences", row)
    if count is None:
        return 1
    if not 1 <= count <= MAX_RETURN_SEQUENCES:
        raise InputError("num_return_sequences", f"must be between 1 and {MAX_RETURN_SEQUENCES}, got {count}")
    return int(count)


def penalties(arrays: dict[str, np.ndarray], row: int) -> Penalties:
    """TensorRT-LLM's penalties (its penalty kernel): presence and frequency count the prompt's tokens too and act
    on the logits after the temperature, which is the engine's formula before it with both scaled by the
    temperature. With the addition `openai_penalties`, OpenAI's: the generated tokens only, before it."""
    beam_width = scalar(arrays, "beam_width", row)
    if beam_width is not None and beam_width != 1:
        raise InputError("beam_width", f"this engine model generates one beam: it must be 1, got {beam_width}")
    repetition, presence, frequency, min_tokens = (
        scalar(arrays, name, row)
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens")
    )
    tensorrt_llm_rule = not scalar(arrays, "openai_penalties", row)
    given = Penalties(
        repetition=1.0 if repetition is None else float(repetition),
        presence=0.0 if presence is None else float(presence),
        frequency=0.0 if frequency is None else float(frequency),
        # TensorRT-LLM's default minimum length is 1: the end id is never the first token unless min_tokens says 0.
        min_tokens=DEFAULT_MIN_TOKENS if min_tokens is None else int(min_tokens),
        count_prompt=tensorrt_llm_rule,
    )
    check_penalties(given)  # as the client sent them, before the scaling below
    if not tensorrt_llm_rule:
        return given
    temperature = scalar(arrays, "temperature", row)  # checked with the sampling parameters
    scale = 1.0 if temperature is None else float(temperature)
    return dataclasses.replace(given, presence=scale * given.presence, frequency=scale * given.frequency)


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
    tokens = np.flatnonzero(bias)
    return tuple(zip(tokens.tolist(), bias[tokens].tolist(), strict=True))


def guide(arrays: dict[str, np.ndarray], row: int) -> Guide | None:
    parsed = parse_guide(
        scalar(arrays, "guided_decoding_guide_type", row), scalar(arrays, "guided_decoding_guide", row)
    )
    return None if parsed is None else Guide(*parsed)


def adapter(arrays: dict[str, np.ndarray], row: int, adapters: AdapterTable) -> str:
    name = scalar(arrays, "lora_name", row)
    return adapters.choose(None if name is None else as_text(name, "lora_name"), scalar(arrays, "lora_task_id", row))


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


@dataclass(frozen=True)
class RowTimes:
    """When a request row was scheduled and got its first and latest tokens (perf_counter, the steady clock)."""

    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None

    @staticmethod
    def after(earlier: RowTimes | None, submitted: float, emission: Emission, generated: int) -> RowTimes:
        """The times once `emission` arrived: the engine's own on a final one (relative to `submitted`), and
        for a stream's earlier ones, when its tokens reached this process."""
        times = earlier or RowTimes()
        if emission.final and emission.time_to_schedule is not None:
            times = dataclasses.replace(times, scheduled=submitted + emission.time_to_schedule)
        if emission.final and emission.time_to_first_token is not None:
            first = submitted + emission.time_to_first_token
            last = first + (emission.time_per_output_token or 0.0) * max(generated - 1, 0)
            return RowTimes(times.scheduled, first, last)
        if not emission.token_ids:
            return times
        now = time.perf_counter()
        return RowTimes(times.scheduled, times.first_token or now, now)


def perf_outputs(
    input_tokens: int,
    generated: int,
    cached: int,
    arrival: float,
    times: RowTimes | None,
    wanted: set[str] | None = None,
) -> dict[str, np.ndarray]:
    """TensorRT-LLM's return_perf_metrics outputs (protocol.PERF_OUTPUTS) of one generation, each [1, 1]; only those
    in `wanted` (the request's requested outputs) when given: a streamed response is built for every token.

    KV cache counts: the portable engine's blocks are one token each; a request holds its prompt's cells and one
    per generated token but the last (never fed back); `cached` of them were an earlier request's (the prefix
    cache). Times: nanoseconds of the steady clock (CLOCK_MONOTONIC, as the executor's), 0 for one not known (the
    transformers engine does not report when it scheduled a request). No speculative decoding: 0 draft tokens."""
    total = input_tokens + max(generated - 1, 0)
    times = times or RowTimes()

    def ns(seconds: float | None) -> int:
        return 0 if seconds is None else round(seconds * 1e9)

    values = {
        **dict(zip(KV_CACHE_OUTPUTS, (total - cached, cached, total), strict=True)),
        "arrival_time_ns": ns(arrival),
        "first_scheduled_time_ns": ns(times.scheduled),
        "first_token_time_ns": ns(times.first_token),
        "last_token_time_ns": ns(times.last_token),
        "acceptance_rate": 0.0,
        "total_accepted_draft_tokens": 0,
        "total_draft_tokens": 0,
    }
    names = PERF_OUTPUTS if wanted is None else [name for name in PERF_OUTPUTS if name in wanted]
    return {name: np.full((1, 1), values[name], dtype=PERF_DTYPES[name]) for name in names}


# The numpy types of the outputs, as model_repository/_shared/tensorrt_llm_io.pbtxt declares them.
PERF_DTYPES = {
    **dict.fromkeys(KV_CACHE_OUTPUTS, np.int32),
    **dict.fromkeys(TIMING_OUTPUTS, np.int64),
    "acceptance_rate": np.float32,
    "total_accepted_draft_tokens": np.int32,
    "total_draft_tokens": np.int32,
}


def stack_rows(rows: list[dict[str, np.ndarray]], pad_id: int) -> dict[str, np.ndarray]:
    """One response for a batch whose rows were answered one by one: each output's rows joined along the batch
    dimension, ragged dimensions padded at the end (output_ids with `pad_id`, as the engine pads, the rest with 0)."""
    if len(rows) == 1:
        return rows[0]
    joined = {}
    for name in rows[0]:
        arrays = [row[name] for row in rows]
        shape = np.max([a.shape for a in arrays], axis=0)
        fill = pad_id if name == "output_ids" else 0
        padded = []
        for array in arrays:
            out = np.full((array.shape[0], *shape[1:]), fill, dtype=array.dtype)
            out[tuple(slice(0, n) for n in array.shape)] = array
            padded.append(out)
        joined[name] = np.concatenate(padded)
    return joined
