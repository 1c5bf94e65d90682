"""Text in, text out: call the `ensemble` model over HTTP with tritonclient.

from client import generate
print(generate("What is the capital of France?", max_tokens=64))
"""

from __future__ import annotations

import contextlib
import http.client
import queue
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tritonllm.protocol import ENSEMBLE, PORTS, STREAMING_MODEL, infer_inputs, request_tensors

__all__ = ["GenerationError", "StreamChunk", "generate", "infer_inputs", "request_tensors", "stream"]

DEFAULT_URL = f"127.0.0.1:{PORTS['http']}"
DEFAULT_GRPC_URL = f"127.0.0.1:{PORTS['grpc']}"


class GenerationError(RuntimeError):
    """The server refused or failed the request; `str()` is the server's message."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


# The token counts come back only when asked for, as from NVIDIA's ensemble.
COUNTS = {"return_num_input_tokens": True, "return_num_output_tokens": True}


def generate(
    prompt: str,
    max_tokens: int = 128,
    *,
    url: str = DEFAULT_URL,
    model: str = ENSEMBLE,
    timeout: float = 600.0,
    **options,
) -> str:
    """Generate text for `prompt`; options are those of `request_tensors` (temperature, top_k, top_p, seed, stop,
    bad_words, chat). Raises GenerationError with the server's message when the request is refused."""
    import tritonclient.http as httpclient  # here: streaming and the helpers need only tritonclient[grpc]

    with httpclient.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout) as triton:
        try:
            result = triton.infer(
                model, infer_inputs(httpclient, request_tensors(prompt, max_tokens, **{**COUNTS, **options}))
            )
        except InferenceServerException as exc:
            raise GenerationError(exc.message(), exc.status()) from None
        except http.client.HTTPException as exc:  # e.g. the server closed the connection while stopping
            raise ConnectionError(f"the server at {url} closed the connection: {exc}") from None
    return result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")


@dataclass(frozen=True)
class StreamChunk:
    """A text delta; the last chunk of a stream also says why generation ended and how many tokens it took."""

    text: str
    finish_reason: str | None = None  # "stop", "length" or "eos" on the final chunk
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


def _scalar(result, name: str):
    value = result.as_numpy(name)
    return None if value is None else value.reshape(-1)[0]


def stream(
    prompt: str,
    max_tokens: int = 128,
    *,
    url: str = DEFAULT_GRPC_URL,
    model: str = STREAMING_MODEL,
    timeout: float = 600.0,
    **options,
) -> Iterator[StreamChunk]:
    """Yield the text as it is generated, over gRPC bidirectional streaming. Closing the generator early
    cancels the request on the server. Options are those of `request_tensors`."""
    tensors = [*request_tensors(prompt, max_tokens, **{**COUNTS, **options}), ("stream", np.array([[True]]), "BOOL")]
    responses: queue.Queue = queue.Queue()
    triton = grpcclient.InferenceServerClient(url)
    finished = False
    try:
        triton.start_stream(callback=lambda result, error: responses.put((result, error)), stream_timeout=timeout)
        # If the stream broke (no server?), the reason arrives through the callback, below.
        with contextlib.suppress(InferenceServerException):
            triton.async_stream_infer(model, infer_inputs(grpcclient, tensors), request_id=uuid.uuid4().hex)
        while True:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise GenerationError(f"no response from the server in {timeout:.0f} s") from None
            if error is not None:
                if error.status() == "StatusCode.UNAVAILABLE":
                    raise ConnectionError(error.message())
                raise GenerationError(error.message(), error.status())
            reason = _scalar(result, "finish_reason")
            text = _scalar(result, "text_output")
            chunk = StreamChunk(
                text=text.decode() if text is not None else "",
                finish_reason=reason.decode() if reason is not None else None,
                num_input_tokens=_int_or_none(_scalar(result, "num_input_tokens")),
                num_output_tokens=_int_or_none(_scalar(result, "num_output_tokens")),
            )
            yield chunk
            if chunk.final:
                finished = True
                return
    finally:
        triton.stop_stream(cancel_requests=not finished)
        triton.close()


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)
