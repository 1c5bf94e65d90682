"""Unit: how the OpenAI layer answers Triton's errors (tritonllm/openai), and its concurrency helpers."""

from __future__ import annotations

import asyncio

import pytest
from tritonclient.utils import InferenceServerException

from tritonllm.errors import ErrorKind, InputError, ServerBusy
from tritonllm.openai.errors import TRITON_MESSAGES, triton_error
from tritonllm.openai.generation import gather_or_cancel, started
from tritonllm.openai.models import APIError


def stream_error(message: str) -> InferenceServerException:
    """An error inside a gRPC stream: tritonclient gives it a message and no status."""
    return InferenceServerException(msg=message)


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        (ErrorKind.INVALID_INPUT, 400),
        (ErrorKind.UNAUTHORIZED, 401),
        (ErrorKind.NOT_FOUND, 404),
        (ErrorKind.TOO_LARGE, 413),
        (ErrorKind.BUSY, 429),
        (ErrorKind.UNAVAILABLE, 503),
        (ErrorKind.INTERNAL, 500),
    ],
)
def test_a_tagged_stream_error_answers_its_kinds_status(kind, status):
    error = triton_error(stream_error(f"{kind.tag} something went wrong"))
    assert (error.kind, error.status) == (kind, status)


def test_a_client_mistake_inside_a_stream_is_400_not_500():
    for exc in (InputError("stop_words", "a word is 300 bytes, over the limit of 256"), InputError("text_input", "x")):
        error = triton_error(stream_error(exc.tagged()))
        assert error.status == 400 and error.type == "invalid_request_error"
        assert "stop_words" in str(error) or "text_input" in str(error)


def test_the_engines_busy_refusal_is_a_rate_limit():
    error = triton_error(stream_error(ServerBusy("server busy: 32 requests are in the engine").tagged()))
    assert (error.status, error.type, error.code) == (429, "rate_limit_exceeded", "server_busy")
    assert "server busy" in str(error)


@pytest.mark.parametrize("status", [None, "StatusCode.UNAVAILABLE"])
def test_tritons_full_queue_is_429_with_or_without_a_status(status):
    """The dynamic batcher's refusal (TensorRT-LLM flavor), as Triton words it, with its request-id prefix."""
    message = "[request id: 7] Exceeds maximum queue size"
    error = triton_error(InferenceServerException(msg=message, status=status))
    assert (error.status, error.type, error.code) == (429, "rate_limit_exceeded", "server_busy")


def test_the_known_triton_messages_are_refusals_of_a_busy_server():
    for text, kind in TRITON_MESSAGES:
        assert triton_error(stream_error(f"in ensemble 'ensemble', {text}")).kind is kind


def test_the_tag_wins_over_tritons_text():
    error = triton_error(stream_error("[invalid_input] stop_words: 'Exceeds maximum queue size' is not a word"))
    assert error.status == 400


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("StatusCode.INVALID_ARGUMENT", 400),
        ("StatusCode.RESOURCE_EXHAUSTED", 413),
        ("StatusCode.UNAVAILABLE", 503),
        ("StatusCode.NOT_FOUND", 503),  # Triton lacks its own model: not the client's unknown model
        ("StatusCode.INTERNAL", 500),
        (None, 500),
    ],
)
def test_an_untagged_error_maps_by_tritons_status_code(status, expected):
    error = triton_error(InferenceServerException(msg="unexpected inference input 'x'", status=status))
    assert error.status == expected


def test_our_own_wording_without_a_tag_is_not_read():
    assert triton_error(stream_error("server busy: retry later")).status == 500


def test_unavailable_says_so():
    error = triton_error(InferenceServerException(msg="failed to connect", status="StatusCode.UNAVAILABLE"))
    assert (error.status, error.type) == (503, "server_error")
    assert "not available" in str(error)


def test_api_error_body_is_openais_format():
    error = APIError(ErrorKind.INVALID_INPUT, "'stop': too long", param="stop")
    assert error.body() == {
        "error": {"message": "'stop': too long", "type": "invalid_request_error", "param": "stop", "code": None}
    }
    assert error.response().status_code == 400


def test_gather_or_cancel_cancels_the_siblings_of_a_failure():
    """A failed choice of n > 1 must not leave its siblings generating: they are cancelled, and awaited."""
    cancelled, finished = [], []

    async def sibling(i: int) -> int:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        finally:
            finished.append(i)
        return i

    async def failing() -> int:
        await asyncio.sleep(0.01)
        raise APIError(ErrorKind.INVALID_INPUT, "refused")

    async def main():
        with pytest.raises(APIError, match="refused"):
            await asyncio.wait_for(gather_or_cancel([sibling(0), failing(), sibling(2)]), timeout=10)
        assert sorted(cancelled) == [0, 2] and sorted(finished) == [0, 2]  # cleaned up before the error returns

    asyncio.run(main())


def test_gather_or_cancel_returns_results_in_order():
    async def value(i: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return i

    assert asyncio.run(gather_or_cancel([value(0, 0.03), value(1, 0.0), value(2, 0.01)])) == [0, 1, 2]


def test_started_raises_an_error_before_the_first_item():
    async def refused():
        raise APIError(ErrorKind.INVALID_INPUT, "refused")
        yield  # an async generator

    async def main():
        with pytest.raises(APIError):
            await started(refused())

    asyncio.run(main())


def test_started_keeps_every_item():
    async def items():
        for i in range(3):
            yield i

    async def main():
        return [i async for i in await started(items())]

    assert asyncio.run(main()) == [0, 1, 2]
