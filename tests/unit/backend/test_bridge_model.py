"""Unit: the default deployment's `tensorrt_llm`, the engine's request/response face (backend.bridge_model)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.backend import fake_pb_utils
from tritonllm.errors import ErrorKind
from tritonllm.protocol import PERF_OUTPUTS


class Workers:
    """Runs each submitted call at once, so a test reads the answer right after `execute`."""

    def submit(self, function, *args) -> None:
        function(*args)


@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


@pytest.fixture
def face(pb_utils):
    from tritonllm.backend.bridge_model import BridgeModel

    model = BridgeModel.__new__(BridgeModel)  # no repository to read
    model.engine_model = "tensorrt_llm_decoupled"
    model.engine_outputs = {"output_ids", "sequence_length", *PERF_OUTPUTS}
    model.reshaped = {}
    model.client = None  # the engine model is called through BLS
    model.workers = Workers()
    return model


def engine_answer(tokens: list[int]) -> list:
    """The engine's final response for a row: its tokens, and every perf output (the C++ backend writes them
    whether they were asked for or not)."""
    tensors = [
        fake_pb_utils.Tensor("output_ids", np.array([[tokens]], np.int32)),
        fake_pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], np.int32)),
    ]
    tensors += [fake_pb_utils.Tensor(name, np.zeros((1, 1), np.int64)) for name in PERF_OUTPUTS]
    return [fake_pb_utils.InferenceResponse(tensors)]


def ask(pb_utils, ids: list[list[int]], requested: list[str], request_id: str = "", **inputs):
    arrays = {"input_ids": np.array(ids, np.int32), "request_output_len": np.full((len(ids), 1), 4, np.int32)}
    request = pb_utils.Request({**arrays, **inputs}, request_id=request_id, requested=requested)
    return request


def test_only_the_requested_outputs_are_answered(face, pb_utils):
    """B1: the C++ backend writes all ten perf outputs with return_perf_metrics; a response carrying outputs the
    client did not ask for is cut in the stub without the GIL (a crash under Python 3.12)."""
    pb_utils.bls_handler = lambda request: engine_answer([5, 6])
    request = ask(pb_utils, [[1, 2]], ["output_ids", "sequence_length"], return_perf_metrics=np.array([[True]]))
    face.execute([request])
    [(response, _)] = request.sender.sent
    assert {t.name() for t in response.output_tensors()} == {"output_ids", "sequence_length"}


def test_a_batch_is_sent_row_by_row_and_answered_in_row_order(face, pb_utils):
    """NVIDIA's non-decoupled tensorrt_llm refuses a batch; this one answers it, each row as it is alone."""
    answers = {1: [5, 6, 7], 3: [8]}
    pb_utils.bls_handler = lambda request: engine_answer(answers[int(request.input("input_ids")[0, 0])])
    request = ask(pb_utils, [[1, 2], [3, 4]], ["output_ids", "sequence_length"], pad_id=np.array([[9], [9]], np.int32))
    face.execute([request])
    assert [r.input("input_ids").tolist() for r in pb_utils.bls_requests] == [[[1, 2]], [[3, 4]]]
    [(response, _)] = request.sender.sent
    output = pb_utils.get_output_tensor_by_name(response, "output_ids").as_numpy()
    assert output.tolist() == [[[5, 6, 7]], [[8, 9, 9]]]
    assert pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().tolist() == [[3], [1]]


def test_the_request_id_reaches_the_engine_so_a_stop_request_ends_it(face, pb_utils):
    pb_utils.bls_handler = lambda request: [fake_pb_utils.InferenceResponse()]  # a stop request's empty answer
    stop = ask(pb_utils, [[1]], [], request_id="42", stop=np.array([[True]]))
    face.execute([stop])
    assert pb_utils.bls_requests[0].request_id == "42"
    [(response, _)] = stop.sender.sent
    assert not response.has_error() and response.output_tensors() == []


@pytest.mark.parametrize(
    ("inputs", "parameters", "field"),
    [
        ({"streaming": np.array([[True]])}, None, "streaming"),
        ({}, {"Streaming": True}, "streaming"),
        ({"num_return_sequences": np.array([[2]], np.int32)}, None, "num_return_sequences"),
    ],
)
def test_what_only_the_decoupled_deployment_serves_is_refused_naming_it(face, pb_utils, inputs, parameters, field):
    request = pb_utils.Request(
        {"input_ids": np.array([[1, 2]], np.int32), **inputs}, requested=["output_ids"], parameters=parameters
    )
    face.execute([request])
    (error,) = request.sender.errors()
    assert ErrorKind.of_message(error.message()) is ErrorKind.INVALID_INPUT
    assert field in error.message() and "--decoupled-mode" in error.message()
    assert pb_utils.bls_requests == [], "nothing reached the engine"


def test_unloading_answers_every_request_it_took(face, pb_utils):
    """Requests still queued for a worker when the model is unloaded get their answers: a cancelled future would
    leave its client without a final response."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    face.workers = ThreadPoolExecutor(1)

    def slow(request):
        time.sleep(0.05)
        return engine_answer([5])

    pb_utils.bls_handler = slow
    requests = [ask(pb_utils, [[1, 2]], ["output_ids"]) for _ in range(3)]
    face.execute(requests)
    face.finalize()
    assert all(len(r.sender.sent) == 1 and r.sender.closed for r in requests)


def test_a_request_past_max_inflight_requests_is_refused_busy_not_queued(face, pb_utils):
    """D4: a plain pool queued it without bound: ever-growing latency under overload, never a 429."""
    import threading

    from tritonllm.backend.admission import BoundedWorkers

    face.workers = BoundedWorkers(1, "tensorrt_llm")
    release, reached = threading.Event(), threading.Event()

    def held(request):
        reached.set()
        assert release.wait(10)
        return engine_answer([5])

    pb_utils.bls_handler = held
    first, second = ask(pb_utils, [[1, 2]], ["output_ids"]), ask(pb_utils, [[1, 2]], ["output_ids"])
    face.execute([first])
    assert reached.wait(10)
    face.execute([second])
    (error,) = second.sender.errors()
    assert ErrorKind.of_message(error.message()) is ErrorKind.BUSY and "max_inflight_requests" in error.message()
    assert error.code() == pb_utils.TritonError.UNAVAILABLE and second.sender.closed
    release.set()
    face.workers.shutdown()
    assert len(first.sender.sent) == 1 and not first.sender.errors() and face.workers.in_flight() == 0
