"""The rules a request's generation controls obey, each written once and naming TensorRT-LLM's inputs: what an engine
refuses before it queues a request, and what the models that read NVIDIA's tensors (text/wire.py) check first.

No torch here: the engine model's stub checks requests with it when the engine runs in a process of its own.
"""

from __future__ import annotations

import math

from tritonllm.engine.api import GenerationRequest, Penalties, SubmitRules, check_request
from tritonllm.errors import InputError
from tritonllm.protocol import GUIDE_TYPES, MAX_TOP_LOG_PROBS

REBUILD_SYNCHRONOUS = "rebuild with --async-batching false"


def check_sampling(temperature, top_k, top_p) -> None:
    """Sampling inputs, whichever engine serves them (top_p 0 = unset, as TensorRT-LLM reads it)."""
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise InputError("temperature", f"must be a finite number >= 0, got {temperature}")
    if top_k is not None and top_k < 0:
        raise InputError("top_k", f"must be >= 0 (0 = no top-k), got {top_k}")
    if top_p is not None and not (math.isfinite(top_p) and 0 <= top_p <= 1):
        raise InputError("top_p", f"must be in [0, 1] (0 = unset), got {top_p}")


def check_penalties(penalties: Penalties) -> None:
    """The penalties and min_tokens as the client gave them (1 and 0 are none)."""
    if not (math.isfinite(penalties.repetition) and penalties.repetition > 0):
        raise InputError("repetition_penalty", f"must be a finite number > 0 (1 = none), got {penalties.repetition}")
    if not math.isfinite(penalties.presence):
        raise InputError("presence_penalty", f"must be a finite number (0 = none), got {penalties.presence}")
    if not math.isfinite(penalties.frequency):
        raise InputError("frequency_penalty", f"must be a finite number (0 = none), got {penalties.frequency}")
    if penalties.min_tokens < 0:
        raise InputError("min_tokens", f"must be >= 0, got {penalties.min_tokens}")


def check_guide_fields(kind: str | None, text: str) -> None:
    """A guide's type and text (TensorRT-LLM's backend ignores an unknown type, or a guide without one)."""
    if kind is None:
        if text:
            raise InputError("guided_decoding_guide_type", "is required with guided_decoding_guide")
        return
    if kind not in GUIDE_TYPES:
        raise InputError("guided_decoding_guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got {kind!r}")
    if kind != "json" and not text:
        raise InputError("guided_decoding_guide", f"is required with guided_decoding_guide_type {kind!r}")


def check_controls(request: GenerationRequest, vocab_size: int | None) -> None:
    """InputError for penalties, embedding bias, log probabilities or a guide out of range. `vocab_size` (when
    known): the model's, which bias token ids must be below."""
    check_penalties(request.penalties)
    for token, value in request.embedding_bias:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise InputError("embedding_bias", f"token id {token} is not in {limit}")
        if math.isnan(value) or value == math.inf:
            raise InputError("embedding_bias", f"token {token}: a bias must be a finite number or -inf, got {value}")
    if not -1 <= request.log_probs <= MAX_TOP_LOG_PROBS:
        raise InputError("num_top_log_probs", f"must be between 0 and {MAX_TOP_LOG_PROBS}, got {request.log_probs}")
    if request.guide is not None:
        check_guide_fields(request.guide.type, request.guide.text)


def check_batching(request: GenerationRequest, async_batching: bool) -> None:
    """InputError for what an engine under asynchronous batching cannot do: there the host prepares a step before
    the previous one has produced its token, which a grammar must see first, and the step's log probabilities
    would be read while the next step writes them."""
    if not async_batching:
        return
    if request.guide is not None:
        raise InputError(
            "guided_decoding_guide",
            f"guided decoding needs synchronous batching, which this engine does not run: {REBUILD_SYNCHRONOUS}",
        )
    if request.log_probs >= 0:
        raise InputError(
            "return_log_probs",
            f"log probabilities need synchronous batching, which this engine does not run: {REBUILD_SYNCHRONOUS}",
        )


def check_fixed_text(request: GenerationRequest) -> None:
    """InputError naming the first control the synthetic benchmark engine, which writes fixed text, cannot honour."""
    refused = [
        (request.sampling.sample, "temperature", "sampling (temperature, runtime_top_k, runtime_top_p)"),
        (not request.penalties.neutral, "repetition_penalty", "penalties"),
        (bool(request.embedding_bias), "embedding_bias", "a bias"),
        (request.log_probs >= 0, "return_log_probs", "log probabilities"),
        (request.guide is not None, "guided_decoding_guide", "guided decoding"),
        (bool(request.bad_words), "bad_words_list", "bad words"),
    ]
    for used, name, what in refused:
        if used:
            raise InputError(name, f"the synthetic benchmark engine writes fixed text: {what} is not available")


def check_submit(request: GenerationRequest, rules: SubmitRules) -> None:
    """InputError, naming the input, for what an engine with these rules refuses in `submit`."""
    check_controls(request, rules.vocab_size)
    check_request(request)
    check_batching(request, rules.async_batching)
    if rules.fixed_text:
        check_fixed_text(request)
