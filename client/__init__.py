"""Text in, text out: call the `ensemble` model over HTTP with tritonclient.

from client import generate
print(generate("What is the capital of France?", max_tokens=64))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

DEFAULT_URL = "127.0.0.1:8000"


class GenerationError(RuntimeError):
    """The server refused or failed the request; `str()` is the server's message."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


def _input(name: str, value: np.ndarray, datatype: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def build_inputs(
    prompt: str,
    max_tokens: int,
    *,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    bad_words: Sequence[str] = (),
    chat: bool = True,
) -> list[httpclient.InferInput]:
    """The ensemble's inputs for one prompt (batch of 1); optional inputs only when given."""
    inputs = [
        _input("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
        _input("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        _input("apply_chat_template", np.array([[chat]], dtype=bool), "BOOL"),
    ]
    for name, value, dtype, datatype in (
        ("temperature", temperature, np.float32, "FP32"),
        ("top_k", top_k, np.int32, "INT32"),
        ("top_p", top_p, np.float32, "FP32"),
        ("seed", seed, np.uint64, "UINT64"),
    ):
        if value is not None:
            inputs.append(_input(name, np.array([[value]], dtype=dtype), datatype))
    for name, words in (("stop_words", stop), ("bad_words", bad_words)):
        if words:
            inputs.append(_input(name, np.array([[w.encode() for w in words]], dtype=object), "BYTES"))
    return inputs


def generate(
    prompt: str,
    max_tokens: int = 128,
    *,
    url: str = DEFAULT_URL,
    model: str = "ensemble",
    timeout: float = 600.0,
    **options,
) -> str:
    """Generate text for `prompt`; options are those of `build_inputs` (temperature, top_k, top_p, seed, stop,
    bad_words, chat). Raises GenerationError with the server's message when the request is refused."""
    with httpclient.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout) as triton:
        try:
            result = triton.infer(model, build_inputs(prompt, max_tokens, **options))
        except InferenceServerException as exc:
            raise GenerationError(exc.message(), exc.status()) from None
    return result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")
