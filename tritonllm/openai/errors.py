"""Triton's errors as the OpenAI API's: by the kind our models tag, Triton's own known text, or its status code."""

from __future__ import annotations

from tritonclient.utils import InferenceServerException

from tritonllm.errors import ErrorKind
from tritonllm.openai.models import APIError

# Triton's own errors, which carry no kind tag, by their text: inside a gRPC stream an error has no
# status code. Only Triton's wording here, never ours (our models tag theirs).
TRITON_MESSAGES: tuple[tuple[str, ErrorKind], ...] = (
    # triton-inference-server/core src/scheduler_utils.cc, PriorityQueue::PolicyQueue::Enqueue (UNAVAILABLE):
    # a dynamic batcher's queue is full (`default_queue_policy { max_queue_size }`, the TensorRT-LLM flavor).
    ("Exceeds maximum queue size", ErrorKind.BUSY),
    # triton-inference-server/core src/dynamic_batch_scheduler.cc (UNAVAILABLE): a request waited in that
    # queue longer than its policy's timeout.
    ("Request timeout expired", ErrorKind.BUSY),
)

# Triton's status codes (gRPC's names, as tritonclient.grpc reports them), for errors without a tag or known text.
TRITON_STATUSES = {
    "StatusCode.INVALID_ARGUMENT": ErrorKind.INVALID_INPUT,
    "StatusCode.RESOURCE_EXHAUSTED": ErrorKind.TOO_LARGE,  # a message over gRPC's size limit
    "StatusCode.UNAVAILABLE": ErrorKind.UNAVAILABLE,
    # The client named the right model (checked here): Triton missing its own model is the server's state.
    "StatusCode.NOT_FOUND": ErrorKind.UNAVAILABLE,
}


def error_kind(error: InferenceServerException) -> ErrorKind:
    """The kind of a Triton error: its tag (our models'), else Triton's own known text, else its status code.

    The tag and the text come first because inside a gRPC stream an error has no status code, and
    because one code covers several kinds (UNAVAILABLE: a full queue, or a server not reachable).
    """
    message = error.message() or str(error)
    kind = ErrorKind.of_message(message)
    if kind is not None:
        return kind
    for text, kind in TRITON_MESSAGES:
        if text in message:
            return kind
    return TRITON_STATUSES.get(str(error.status() or ""), ErrorKind.INTERNAL)


def triton_error(error: InferenceServerException) -> APIError:
    """Triton's error as OpenAI's, with its kind's status: a client's mistake is never a 500."""
    return api_error(error_kind(error), error.message() or str(error))


def api_error(kind: ErrorKind, message: str) -> APIError:
    """An error of `kind` as OpenAI's (Triton's, or the engine's own when the layer reaches it directly)."""
    if kind is ErrorKind.BUSY:
        return APIError(kind, message, code="server_busy")
    if kind is ErrorKind.UNAVAILABLE:
        return APIError(kind, f"the Triton server is not available: {message}")
    return APIError(kind, message)
