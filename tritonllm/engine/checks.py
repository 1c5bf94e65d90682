"""What an engine refuses of a request's generation controls before it queues it, naming TensorRT-LLM's inputs.

No torch here: the engine model's stub checks requests with it when the engine runs in a process of its own.
"""

from __future__ import annotations

import math

from tritonllm.engine.api import GenerationRequest
from tritonllm.errors import InputError
from tritonllm.protocol import GUIDE_TYPES, MAX_TOP_LOG_PROBS

REBUILD_SYNCHRONOUS = "rebuild with --async-batching false"


def check_controls(request: GenerationRequest, vocab_size: int | None = None) -> None:
    """InputError for penalties, embedding bias, log probabilities or a guide out of range. `vocab_size` (when
    known): the model's, which bias token ids must be below."""
    penalties = request.penalties
    if not (math.isfinite(penalties.repetition) and penalties.repetition > 0):
        raise InputError("repetition_penalty", f"must be a finite number > 0, got {penalties.repetition}")
    if not math.isfinite(penalties.presence):
        raise InputError("presence_penalty", f"must be a finite number, got {penalties.presence}")
    if not math.isfinite(penalties.frequency):
        raise InputError("frequency_penalty", f"must be a finite number, got {penalties.frequency}")
    if penalties.min_tokens < 0:
        raise InputError("min_tokens", f"must be >= 0, got {penalties.min_tokens}")
    for token, value in request.embedding_bias:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise InputError("embedding_bias", f"token id {token} is not in {limit}")
        if math.isnan(value) or value == math.inf:
            raise InputError("embedding_bias", f"token {token}: a bias must be a finite number or -inf, got {value}")
    if request.log_probs < -1:
        raise InputError("num_top_log_probs", f"must be >= 0, got {request.log_probs}")
    if request.log_probs > MAX_TOP_LOG_PROBS:
        raise InputError("num_top_log_probs", f"{request.log_probs} is more than the limit of {MAX_TOP_LOG_PROBS}")
    guide = request.guide
    if guide is not None:
        if guide.type not in GUIDE_TYPES:
            raise InputError("guided_decoding_guide_type", f"{guide.type!r} is not one of {', '.join(GUIDE_TYPES)}")
        if guide.type != "json" and not guide.text:
            raise InputError("guided_decoding_guide", f"a {guide.type} guide needs its text")


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
