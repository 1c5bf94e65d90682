"""A stand-in for tritonserver's `triton_python_backend_utils`, so the Python-backend adapters run in unit tests.

Only what the adapters use, with the real module's names and codes; it records what a model logs and
sends. `install(monkeypatch)` puts this module in `sys.modules` under the real name and clears what an
earlier test recorded; import the adapters after it, e.g. in a fixture:

    @pytest.fixture
    def pb_utils(monkeypatch):
        return fake_pb_utils.install(monkeypatch)

A BLS call (`InferenceRequest.exec`) answers with what `bls_handler` returns for the request, so a test
decides what a callee model answers. Metric families a model makes are kept in `metric_families`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import ClassVar

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

MODULE_NAME = "triton_python_backend_utils"


class TritonError:
    """The codes are TRITONSERVER_Error_Code's, as the real class's are."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self._outputs, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_tensor_by_name(request, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


class ResponseSender:
    """Records each `send` as (response, flags); `cancelled` is what `is_cancelled` answers, until the final
    response: asked after it, the real server crashes.

    A response carrying an output its request did not ask for is refused: the real stub drops such
    outputs without the GIL and crashes (see tritonllm.backend.triton_glue.requested_outputs)."""

    def __init__(self, requested: list[str] | None = None) -> None:
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.cancelled = False
        self.requested = set(requested or [])  # empty: all outputs, as Triton fills a request that names none

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if response is not None and self.requested:
            extra = sorted({t.name() for t in response.output_tensors()} - self.requested)
            if extra:
                raise AssertionError(f"response carries outputs the request did not ask for: {extra}")
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        # tritonserver 2.51 reads the freed response factory of a request answered in full: a segfault.
        if self.closed:
            raise AssertionError("is_cancelled asked after the final response")
        return self.cancelled

    @property
    def closed(self) -> bool:
        return any(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL for _, flags in self.sent)

    def errors(self) -> list[TritonError]:
        return [r.error() for r, _ in self.sent if r is not None and r.has_error()]


class Request:
    """A client's request as `execute` gets it."""

    def __init__(
        self,
        inputs: dict[str, np.ndarray],
        request_id: str = "",
        requested: list[str] | None = None,
        parameters: dict | None = None,
    ):
        self._inputs = [Tensor(name, array) for name, array in inputs.items()]
        self._id, self._requested = request_id, list(requested or [])
        self._parameters = json.dumps(parameters or {})
        self.sender = ResponseSender(self._requested)

    def parameters(self) -> str:
        return self._parameters

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._id

    def requested_output_names(self) -> list[str]:
        return self._requested

    def get_response_sender(self) -> ResponseSender:
        return self.sender


class InferenceRequest:
    """A BLS request; `exec` answers with `bls_handler(self)` and records the request in `bls_requests`."""

    def __init__(
        self, model_name: str, inputs: list[Tensor], requested_output_names: list[str], request_id: str = "", **_
    ):
        self.model_name, self.inputs, self.request_id = model_name, list(inputs), request_id
        self.requested_output_names = list(requested_output_names)

    def input(self, name: str) -> np.ndarray | None:
        return next((t.as_numpy() for t in self.inputs if t.name() == name), None)

    def exec(self, decoupled: bool = False):
        bls_requests.append(self)
        responses = list(bls_handler(self))
        return iter(responses) if decoupled else responses[0]


class Logger:
    """Records (level, message) in `records`."""

    records: ClassVar[list[tuple[str, str]]] = []

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.records.append(("info", message))

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.records.append(("warn", message))

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.records.append(("error", message))

    @classmethod
    def log_verbose(cls, message: str) -> None:
        cls.records.append(("verbose", message))

    @classmethod
    def errors(cls) -> list[str]:
        return [message for level, message in cls.records if level == "error"]


class Metric:
    """One labelled metric: `value()` is a counter's or gauge's value; a histogram's observations are in `observed`;
    `increments` counts the calls to `increment` (each a round trip to the server in the real stub)."""

    def __init__(self, labels: dict[str, str], buckets: list[float] | None = None) -> None:
        self.labels, self.buckets = dict(labels), buckets
        self._value = 0.0
        self.observed: list[float] = []
        self.increments = 0

    def increment(self, by: float) -> None:
        self._value += by
        self.increments += 1

    def set(self, value: float) -> None:
        self._value = value

    def observe(self, value: float) -> None:
        self.observed.append(value)

    def value(self) -> float:
        return self._value


class MetricFamily:
    """Recorded in `metric_families`, with the metrics made from it in `metrics`."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[Metric] = []
        metric_families.append(self)

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> Metric:  # the real method name
        metric = Metric(labels, buckets)
        self.metrics.append(metric)
        return metric


def using_decoupled_model_transaction_policy(config: dict) -> bool:
    return bool(config.get("model_transaction_policy", {}).get("decoupled", False))


def _no_callee(request: InferenceRequest) -> list[InferenceResponse]:
    raise AssertionError(f"unexpected BLS call to {request.model_name}: set fake_pb_utils.bls_handler")


bls_handler: Callable[[InferenceRequest], list[InferenceResponse]] = _no_callee
bls_requests: list[InferenceRequest] = []
metric_families: list[MetricFamily] = []


def install(monkeypatch) -> object:
    """This module as `triton_python_backend_utils` for one test, with nothing recorded yet; returns it."""
    module = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, MODULE_NAME, module)
    monkeypatch.setattr(Logger, "records", [])
    monkeypatch.setattr(module, "bls_handler", _no_callee)
    monkeypatch.setattr(module, "bls_requests", [])
    monkeypatch.setattr(module, "metric_families", [])
    return module
