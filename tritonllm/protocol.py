"""The contract between the parts: model names, the ensemble's client tensors, finish reasons, limits, ports.

The example client, the Python-backend adapters, the OpenAI layer and the benchmarks import these
names from here and nowhere else, so the wire format is defined once.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

import numpy as np

# Model names: those of NVIDIA's reference inflight_batcher_llm repository, plus the bridge.
ENSEMBLE = "ensemble"
PREPROCESSING = "preprocessing"
POSTPROCESSING = "postprocessing"
# tensorrt_llm: request/response in the default deployment (NVIDIA's decoupled_mode false), where the engine itself
# (the TensorRT-LLM C++ backend or the portable engine) is tensorrt_llm_decoupled, which tensorrt_llm_bls streams
# from; with decoupled_mode, tensorrt_llm is the engine, and the ensemble streams, as NVIDIA's.
ENGINE_MODEL = "tensorrt_llm"
DECOUPLED_ENGINE_MODEL = "tensorrt_llm_decoupled"
STREAMING_MODEL = "tensorrt_llm_bls"


def engine_model(decoupled_mode: bool) -> str:
    """The model that runs the engine and streams its tokens, in the deployment `decoupled_mode` says."""
    return ENGINE_MODEL if decoupled_mode else DECOUPLED_ENGINE_MODEL


PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}  # Triton's defaults
OPENAI_PORT = 9000


def bound_socket(host: str, port: int, reuse_addr: bool = True, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to host:port, not listening (IPv6 where the host has a colon, uvicorn's rule); OSError where
    it cannot be bound. SO_REUSEADDR by default, as servers bind: connections left in TIME_WAIT do not hold the port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse_addr))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(reuse_port))
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost): the launchers' admin key and
    the OpenAI layer's open-key warning both turn on it."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to any address
        return False


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not listen on host:port (another listens there, mostly)."""
    try:
        bound_socket(host, port).close()
    except OSError:
        return True
    return False


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

# TensorRT-LLM's default minimum length (DefaultDecodingParams::getMinLength): the end id never comes first.
DEFAULT_MIN_TOKENS = 1

MAX_BIASED_TOKENS = 1024  # embedding_bias_words, and logit_bias_token_ids, per request
MAX_TOP_LOG_PROBS = 20  # most likely tokens returned per position (OpenAI's top_logprobs limit)
MAX_RETURN_SEQUENCES = 16  # num_return_sequences per prompt, as the OpenAI layer's n
# TensorRT-LLM's guided decoding types (its `guided_decoding_guide_type` values), which both engines take.
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")

# TensorRT-LLM's per-request KV cache counts, returned with return_perf_metrics (the portable engine's blocks are
# one token each); the reused blocks are the prompt's part that an earlier request's cache served.
KV_CACHE_OUTPUTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
# The rest of TensorRT-LLM's return_perf_metrics outputs: a request's times (INT64 nanoseconds of the steady clock,
# 0 where the engine does not know one), and speculative decoding's counts (0 without a draft model).
TIMING_OUTPUTS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
DRAFT_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
PERF_OUTPUTS = KV_CACHE_OUTPUTS + TIMING_OUTPUTS + DRAFT_OUTPUTS
# Additions of the Python-backend engine models: a request with ERRORS_IN_BAND true gets an error that comes after its
# first response as the GENERATION_ERROR output (the tagged text) of a final response, not as an error response.
# Through BLS, tritonserver 2.51's Python backend never delivers an error response that follows another response to
# the caller's iterator, whose stream then waits for ever; tensorrt_llm_bls sets it. (An input, not the output's
# name alone: Triton asks for every output of a request that names none.)
ERRORS_IN_BAND = "errors_in_band"
GENERATION_ERROR = "generation_error"

# The llama.cpp engine's prefix cache as KV-cache events (tritonllm/engine/kv_events.py): where the serving process's
# environment names a ZeroMQ endpoint, the engine publishes its kept blocks there, of this many tokens each, for a
# Dynamo worker to relay to Dynamo's KV router (tritonllm/dynamo).
KV_EVENTS_ENV = "TRITONLLM_KV_EVENTS"
KV_EVENT_BLOCK_TOKENS = 16

Tensors = list[tuple[str, np.ndarray, str]]  # (name, value, Triton datatype)


# The ensemble's (and tensorrt_llm_bls's) optional one-value inputs: name -> (numpy type, Triton datatype). The
# names are NVIDIA's reference ensemble's, except the additions apply_chat_template, and num_top_log_probs,
# openai_penalties and lora_name (the portable engine's: model_repository/_shared/portable_text_io.pbtxt).
SCALAR_INPUTS: dict[str, tuple[type, str]] = {
    "temperature": (np.float32, "FP32"),
    "top_k": (np.int32, "INT32"),
    "top_p": (np.float32, "FP32"),
    "seed": (np.uint64, "UINT64"),
    "repetition_penalty": (np.float32, "FP32"),
    "presence_penalty": (np.float32, "FP32"),
    "frequency_penalty": (np.float32, "FP32"),
    "length_penalty": (np.float32, "FP32"),
    "min_tokens": (np.int32, "INT32"),
    "beam_width": (np.int32, "INT32"),
    "end_id": (np.int32, "INT32"),
    "pad_id": (np.int32, "INT32"),
    "return_log_probs": (bool, "BOOL"),
    "num_top_log_probs": (np.int32, "INT32"),
    "openai_penalties": (bool, "BOOL"),
    "exclude_input_in_output": (bool, "BOOL"),
    "return_num_input_tokens": (bool, "BOOL"),
    "return_num_output_tokens": (bool, "BOOL"),
    "return_perf_metrics": (bool, "BOOL"),
    "stream": (bool, "BOOL"),
    "guided_decoding_guide_type": (object, "BYTES"),
    "guided_decoding_guide": (object, "BYTES"),
    "lora_task_id": (np.uint64, "UINT64"),
    "lora_name": (object, "BYTES"),
}


def request_tensors(
    prompt: str,
    max_tokens: int,
    *,
    stop: Sequence[str] = (),
    bad_words: Sequence[str] = (),
    chat: bool = True,
    embedding_bias: dict[str, float] | None = None,
    logit_bias: dict[int, float] | None = None,
    **scalars,
) -> Tensors:
    """The ensemble's (and tensorrt_llm_bls's) inputs for one prompt; optional ones only when given (not None).

    `scalars` are SCALAR_INPUTS by name; `embedding_bias` maps words to a bias (embedding_bias_words /
    embedding_bias_weights), `logit_bias` token ids to one (logit_bias_token_ids / logit_bias_weights)."""
    tensors = [
        ("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
        ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        ("apply_chat_template", np.array([[chat]], dtype=bool), "BOOL"),
    ]
    for name, value in scalars.items():
        if name not in SCALAR_INPUTS:
            raise TypeError(f"request_tensors: unknown input {name!r}")
        if value is None:
            continue
        dtype, datatype = SCALAR_INPUTS[name]
        tensors.append((name, np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype), datatype))
    for name, words in (("stop_words", stop), ("bad_words", bad_words)):
        if words:
            tensors.append((name, np.array([[w.encode() for w in words]], dtype=object), "BYTES"))
    if embedding_bias:
        tensors.append(
            ("embedding_bias_words", np.array([[w.encode() for w in embedding_bias]], dtype=object), "BYTES")
        )
        tensors.append(("embedding_bias_weights", np.array([list(embedding_bias.values())], dtype=np.float32), "FP32"))
    if logit_bias:
        tensors.append(("logit_bias_token_ids", np.array([list(logit_bias)], dtype=np.int32), "INT32"))
        tensors.append(("logit_bias_weights", np.array([list(logit_bias.values())], dtype=np.float32), "FP32"))
    return tensors


HEALTH_PROBE_ID = "tritonllm-health-probe"  # the request id of the health probe's `stop` (tritonllm/engine/health.py)


def stop_request_tensors() -> Tensors:
    """TensorRT-LLM's `stop` request: ends the request of the same request id (both engines answer it at once)."""
    one = np.ones((1, 1), dtype=np.int32)
    return [
        ("input_ids", one, "INT32"),
        ("input_lengths", one, "INT32"),
        ("request_output_len", one, "INT32"),
        ("stop", np.array([[True]]), "BOOL"),
    ]


# The engine model's LoRA administration (docs/lora.md): a request with `lora_action` loads, unloads or lists
# adapters, and answers with LORA_ADAPTERS_OUTPUT, the adapters loaded (JSON: [{"name", "task_id"}, ...]). Loading
# and unloading need the build's --lora-dir, and the server's admin key where it has one (ADMIN_KEY_ENV).
LORA_ACTIONS = ("load", "unload", "list")
LORA_ADAPTERS_OUTPUT = "lora_adapters"
ADMIN_KEY_ENV = "TRITONLLM_ADMIN_KEY"
ADMIN_HEADER = "tritonllm-admin-key"  # the header of Triton's restricted APIs and the OpenAI layer's adapter routes


def lora_admin_tensors(
    action: str, name: str = "", path: str = "", task_id: int | None = None, admin_key: str | None = None
) -> Tensors:
    """A `lora_action` request to the engine model (its required inputs hold one token; nothing is generated)."""
    one = np.ones((1, 1), dtype=np.int32)
    tensors = [
        ("input_ids", one, "INT32"),
        ("input_lengths", one, "INT32"),
        ("request_output_len", one, "INT32"),
        ("lora_action", np.array([[action.encode()]], dtype=object), "BYTES"),
    ]
    for field, text in (("lora_name", name), ("lora_path", path), ("lora_admin_key", admin_key)):
        if text:
            tensors.append((field, np.array([[text.encode()]], dtype=object), "BYTES"))
    if task_id is not None:
        tensors.append(("lora_task_id", np.array([[task_id]], dtype=np.uint64), "UINT64"))
    return tensors


def infer_inputs(module, tensors: Tensors) -> list:
    """tritonclient InferInput objects of `module` (tritonclient.http or tritonclient.grpc)."""
    inputs = []
    for name, value, datatype in tensors:
        tensor = module.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs
