"""The contract between the parts: model names, the ensemble's client tensors, finish reasons, limits, ports.

The example client, the Python-backend adapters, the OpenAI layer and the benchmarks import these
names from here and nowhere else, so the wire format is defined once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Model names: those of NVIDIA's reference inflight_batcher_llm repository, plus the bridge.
ENSEMBLE = "ensemble"
PREPROCESSING = "preprocessing"
POSTPROCESSING = "postprocessing"
ENGINE_MODEL = "tensorrt_llm"  # both flavors: the TensorRT-LLM C++ backend, or the portable engine
STREAMING_MODEL = "tensorrt_llm_bls"
BRIDGE_MODEL = "tensorrt_llm_bridge"

PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}  # Triton's defaults
OPENAI_PORT = 9000

# Why a sequence ended, as the ensemble's `finish_reason` output and the engine's emissions say it.
FINISH_EOS = "eos"  # the model produced the end id
FINISH_STOP = "stop"  # a stop string or stop word appeared
FINISH_LENGTH = "length"  # max_tokens, or the sequence length limit, was reached
FINISH_CANCELLED = "cancelled"  # the client cancelled, or TensorRT-LLM's `stop` input ended it
FINISH_ERROR = "error"
FINISH_REASONS = (FINISH_EOS, FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR)

MAX_WORDS = 32  # stop or bad word strings per request
MAX_WORD_BYTES = 256  # bytes per stop or bad word
# Preprocessing turns each word into two token sequences (as written, and after a space), so the engine
# takes twice as many sequences as a client may send words.
MAX_WORD_SEQUENCES = 2 * MAX_WORDS

Tensors = list[tuple[str, np.ndarray, str]]  # (name, value, Triton datatype)


def request_tensors(
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
) -> Tensors:
    """The ensemble's (and tensorrt_llm_bls's) inputs for one prompt; optional ones only when given."""
    tensors = [
        ("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
        ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        ("apply_chat_template", np.array([[chat]], dtype=bool), "BOOL"),
    ]
    for name, value, dtype, datatype in (
        ("temperature", temperature, np.float32, "FP32"),
        ("top_k", top_k, np.int32, "INT32"),
        ("top_p", top_p, np.float32, "FP32"),
        ("seed", seed, np.uint64, "UINT64"),
    ):
        if value is not None:
            tensors.append((name, np.array([[value]], dtype=dtype), datatype))
    for name, words in (("stop_words", stop), ("bad_words", bad_words)):
        if words:
            tensors.append((name, np.array([[w.encode() for w in words]], dtype=object), "BYTES"))
    return tensors


def stop_request_tensors() -> Tensors:
    """TensorRT-LLM's `stop` request: ends the request of the same request id (both engines answer it at once)."""
    one = np.ones((1, 1), dtype=np.int32)
    return [
        ("input_ids", one, "INT32"),
        ("input_lengths", one, "INT32"),
        ("request_output_len", one, "INT32"),
        ("stop", np.array([[True]]), "BOOL"),
    ]


def infer_inputs(module, tensors: Tensors) -> list:
    """tritonclient InferInput objects of `module` (tritonclient.http or tritonclient.grpc)."""
    inputs = []
    for name, value, datatype in tensors:
        tensor = module.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs
