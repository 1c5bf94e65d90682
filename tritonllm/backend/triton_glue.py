"""What every Python-backend model of the repository shares: tensors in and out, errors, parameters.

Imported only inside tritonserver's Python-backend stub, where `triton_python_backend_utils` exists.
"""

from __future__ import annotations

import gc
import json
import traceback
from collections.abc import Callable, Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonllm.errors import ErrorKind, InputError, TritonLLMError
from tritonllm.protocol import GENERATION_ERROR

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def log_info(message: str) -> None:
    """Into tritonserver's own log, with its timestamps."""
    pb_utils.Logger.log_info(message)


def log_error(message: str) -> None:
    """An error that is not an exception being handled: no traceback to add."""
    pb_utils.Logger.log_error(message)


def log_exception(message: str) -> None:
    """Only inside an `except` block: outside one the traceback reads "NoneType: None"."""
    pb_utils.Logger.log_error(f"{message}\n{traceback.format_exc()}")


def model_config(args: dict) -> dict:
    return json.loads(args["model_config"])


def parameters(config: dict) -> dict[str, str]:
    """The model's `parameters { key: ... value: { string_value: ... } }` as a plain dict."""
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


# Request parameters of the KServe v2 protocol and Triton's extensions, which clients and Triton itself set.
TRITON_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output", "binary_data_size"}
)


# Request parameters that clients send to tensorrt_llm for one of its inputs: NVIDIA's
# inflight_batcher_llm_client.py sends `Streaming` with every request (its `stop` requests too).
ENGINE_PARAMETER_INPUTS = {"Streaming": "streaming"}


def input_arrays(request, parameter_inputs: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Every input of a request as a numpy array (copied: it outlives the request's shared memory).

    `parameter_inputs` names request parameters that stand for an input (ENGINE_PARAMETER_INPUTS): such a
    parameter is that input when the request does not send it, and must agree with it when it does. Raises
    InputError for any other request parameter no model reads: HTTP /generate turns JSON keys that are not inputs
    into parameters, so a misspelt or unsupported input would otherwise be ignored without a word."""
    raw = request.parameters()
    given = json.loads(raw) if raw and raw != "{}" else {}
    aliases = parameter_inputs or {}
    unknown = sorted(set(given) - TRITON_PARAMETERS - aliases.keys())
    if unknown:
        raise InputError(unknown[0], "is not an input of this model (over HTTP /generate, a key that is not an input)")
    arrays = {tensor.name(): np.array(tensor.as_numpy(), copy=True) for tensor in request.inputs()}
    for parameter, name in aliases.items():
        if parameter not in given:
            continue
        value = given[parameter]
        if not isinstance(value, bool):
            raise InputError(parameter, f"must be true or false, got {value!r}")
        if name in arrays and bool(arrays[name].reshape(-1)[0]) != value:
            raise InputError(parameter, f"is {str(value).lower()} but the input {name} says otherwise")
        arrays.setdefault(name, np.array([[value]], dtype=bool))
    return arrays


def to_tensors(outputs: dict[str, np.ndarray], wanted: set[str] | None) -> list:
    """The tensors of a response, only those in `wanted`: the request's `requested_outputs`, always."""
    return [pb_utils.Tensor(name, array) for name, array in outputs.items() if wanted is None or name in wanted]


class StepError(Exception):
    """A model called through BLS answered with an error; it is passed on with its code."""

    def __init__(self, error) -> None:
        super().__init__(error.message())
        self.error = error


def exec_decoupled(request, keep: list):
    """`request.exec(decoupled=True)`, its response iterator also appended to `keep`.

    The stub (tritonserver 2.51, and upstream since) hands a finished iterator's cleanup to its
    helper thread, which drops the stub's own reference without the GIL: if Python let go first,
    the iterator and its tensors' numpy arrays are freed there, without the GIL, and the
    interpreter's memory is corrupted (segfaults under load). The helper thread serves its queue
    in order, and `is_cancelled()` is served by it too: so keep the iterator until an
    `is_cancelled()` asked after its final response has returned (`settle_after`), and
    Python's reference is the last one.
    """
    responses = request.exec(decoupled=True)
    keep.append(responses)
    return responses


def settle_after(sender, keep: list) -> None:
    """Drop the iterators kept by `exec_decoupled`, after an `is_cancelled()` round trip.

    Only for a sender no other thread asks and that was not found cancelled before: the stub
    answers those without a round trip (tensorrt_llm_bls handles both cases itself).
    """
    sender.is_cancelled()
    keep.clear()


def free_before_exit() -> None:
    """The last step of a model's `finalize`: free now what reference cycles still hold (a request's response
    sender, a metric family). Left to the interpreter's last collection at the stub's exit, a ResponseSender's
    destructor reaches for shared memory the server has already taken back: a segfault in ~ResponseSender, and
    tritonserver exits nonzero."""
    gc.collect()


def raise_if_error(response) -> None:
    """A BLS callee's error, in its error response or in band (GENERATION_ERROR), as a StepError."""
    if response.has_error():
        raise StepError(response.error())
    failure = pb_utils.get_output_tensor_by_name(response, GENERATION_ERROR)
    if failure is not None:
        message = failure.as_numpy().reshape(-1)[0].decode(errors="replace")
        kind = ErrorKind.of_message(message) or ErrorKind.INTERNAL
        raise StepError(pb_utils.TritonError(message, getattr(pb_utils.TritonError, kind.triton_code)))


def error_kind(exc: BaseException) -> ErrorKind | None:
    """How `exc` is answered: our errors carry their kind, a BLS callee's its tag (None: an untagged callee's
    error, passed on with its own code); anything else is a bug of ours, INTERNAL. The metrics count by it too."""
    if isinstance(exc, StepError):
        return ErrorKind.of_message(exc.error.message())
    if isinstance(exc, TritonLLMError):
        return exc.kind
    return ErrorKind.INTERNAL


def error_response(exc: BaseException):
    """The response that fails a request with `exc`, its message tagged with its kind (see tritonllm.errors);
    a bug of ours is logged with its traceback."""
    return pb_utils.InferenceResponse(error=triton_error(exc))


def triton_error(exc: BaseException):
    """`exc` as a TritonError: its kind's code, its message tagged with the kind (error_response's rules)."""
    kind = error_kind(exc)
    if isinstance(exc, StepError):  # a BLS response's error code does not survive the stub: its tag does
        code = exc.error.code() if kind is None else getattr(pb_utils.TritonError, kind.triton_code)
        return pb_utils.TritonError(exc.error.message(), code)
    if isinstance(exc, TritonLLMError):
        return pb_utils.TritonError(exc.tagged(), getattr(pb_utils.TritonError, kind.triton_code))
    pb_utils.Logger.log_error("".join(traceback.format_exception(exc)))
    return pb_utils.TritonError(f"{ErrorKind.INTERNAL.tag} internal error: {exc}", pb_utils.TritonError.INTERNAL)


def in_band_error_response(exc: BaseException):
    """The final response that carries `exc` as the GENERATION_ERROR output (tritonllm.protocol says why)."""
    message = triton_error(exc).message()
    return pb_utils.InferenceResponse([pb_utils.Tensor(GENERATION_ERROR, np.array([[message.encode()]], dtype=object))])


def requested_outputs(request) -> set[str] | None:
    """The outputs a request asked for (None: all). A response must carry no other.

    The stub (tritonserver 2.51, and upstream since) drops the outputs a request did not ask for
    in `ResponseSender.send` after releasing the GIL: the dropped tensors' numpy arrays are freed
    without it. Under Python 3.12 that is a segfault in the stub (`_PyObject_Free` finds no thread
    state) at the first such response; under 3.11 it corrupts the heap, which shows later and
    rarely. So every response is cut to the request's outputs here, under the GIL.
    """
    names = request.requested_output_names()
    return set(names) if names else None


def run_batch(requests: Sequence, process: Callable[[list[dict[str, np.ndarray]]], list]) -> list:
    """Answer a batch of requests with `process`, which maps input arrays to output arrays or an error each."""
    answers: list = [None] * len(requests)
    taken = []
    for index, request in enumerate(requests):
        try:
            taken.append((index, input_arrays(request)))
        except Exception as exc:  # this request alone
            answers[index] = error_response(exc)
    try:
        results = process([arrays for _, arrays in taken])
    except Exception as exc:  # a bug must fail these requests, not the model
        results = [exc] * len(taken)
    for (index, _), result in zip(taken, results, strict=True):
        answers[index] = (
            error_response(result)
            if isinstance(result, Exception)
            else pb_utils.InferenceResponse(output_tensors=to_tensors(result, requested_outputs(requests[index])))
        )
    return answers
