"""Unit: how the Python-backend adapters answer errors (backend.triton_glue, backend.bls_model), on a fake pb_utils."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from tests.unit.backend import fake_pb_utils
from tritonllm.errors import EngineFailure, ErrorKind, InputError, ServerBusy
from tritonllm.protocol import ERRORS_IN_BAND, GENERATION_ERROR, KV_CACHE_OUTPUTS
from tritonllm.text.pipeline import Delta


@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


@pytest.fixture
def glue(pb_utils):
    from tritonllm.backend import triton_glue

    return triton_glue


@pytest.fixture
def bls(pb_utils):
    from tritonllm.backend import bls_model

    model = bls_model.StreamingModel.__new__(bls_model.StreamingModel)  # no tokenizer or workers needed
    model.engine_model = "tensorrt_llm"
    model.in_band = True  # the portable engine model takes errors_in_band
    model.client = None  # the engine model is called through BLS (an engine in its process)
    model._live = {}
    model._unsettled = []
    return bls_model, model


@pytest.mark.parametrize(
    ("error", "kind", "code"),
    [
        (InputError("max_tokens", "must be >= 1"), ErrorKind.INVALID_INPUT, "INVALID_ARG"),
        (ServerBusy("the engine is full"), ErrorKind.BUSY, "UNAVAILABLE"),
        (EngineFailure("the engine stopped"), ErrorKind.INTERNAL, "INTERNAL"),
    ],
)
def test_our_errors_answer_their_kinds_code_and_tag(glue, pb_utils, error, kind, code):
    response = glue.error_response(error)
    assert response.error().code() == getattr(pb_utils.TritonError, code)
    assert response.error().message() == f"{kind.tag} {error}"
    assert ErrorKind.of_message(response.error().message()) is kind


def test_a_callees_error_passes_on_with_its_message_and_code(glue, pb_utils):
    callee = pb_utils.TritonError("[busy] the engine is full", pb_utils.TritonError.UNAVAILABLE)
    response = glue.error_response(glue.StepError(callee))
    assert (response.error().message(), response.error().code()) == (callee.message(), callee.code())
    assert pb_utils.Logger.errors() == []


def test_a_bug_is_internal_tagged_and_logged_with_its_traceback(glue, pb_utils):
    try:
        {}["missing"]
    except KeyError as exc:
        response = glue.error_response(exc)
    assert response.error().code() == pb_utils.TritonError.INTERNAL
    assert ErrorKind.of_message(response.error().message()) is ErrorKind.INTERNAL
    (logged,) = pb_utils.Logger.errors()
    assert "Traceback" in logged and "KeyError" in logged


def test_bls_refuses_a_batch_as_invalid_input(bls, pb_utils):
    _, model = bls
    request = pb_utils.Request({"text_input": np.array([[b"a"], [b"b"]], dtype=object)})
    model.execute([request])
    (error,) = request.sender.errors()
    assert error.code() == pb_utils.TritonError.INVALID_ARG
    assert ErrorKind.of_message(error.message()) is ErrorKind.INVALID_INPUT
    assert request.sender.closed


def test_a_failed_stop_request_is_logged_without_a_bogus_traceback(bls, pb_utils):
    bls_model, _ = bls
    pb_utils.bls_handler = lambda request: [
        pb_utils.InferenceResponse(error=pb_utils.TritonError("engine gone", pb_utils.TritonError.INTERNAL))
    ]
    bls_model._BlsStream("tensorrt_llm", "42", {}, [], True, []).stop()
    (stop,) = pb_utils.bls_requests
    assert (stop.model_name, stop.request_id, bool(stop.input("stop").item())) == ("tensorrt_llm", "42", True)
    (logged,) = pb_utils.Logger.errors()
    assert "42" in logged and "engine gone" in logged
    assert "NoneType" not in logged and "Traceback" not in logged


def engine_stream(bls_model, request_id: str):
    return bls_model._BlsStream("tensorrt_llm", request_id, {}, [], True, [])


def test_a_cancelled_request_waiting_in_the_engine_is_stopped_by_the_sender_thread(bls, pb_utils):
    """Its worker waits for the engine's next response, which a request in the engine's queue does not get
    until it runs: the periodic cancellation check must stop it, once."""
    bls_model, model = bls
    pb_utils.bls_handler = lambda request: [pb_utils.InferenceResponse()]
    waiting = bls_model._Request(pb_utils.ResponseSender(), engine=engine_stream(bls_model, "7"))
    preprocessing = bls_model._Request(pb_utils.ResponseSender())  # no engine request yet: nothing to stop
    running = bls_model._Request(pb_utils.ResponseSender(), engine=engine_stream(bls_model, "8"))
    waiting.sender.cancelled = preprocessing.sender.cancelled = True
    model._live = {id(state): state for state in (waiting, preprocessing, running)}
    model._check_cancelled()
    model._check_cancelled()
    assert [(r.request_id, bool(r.input("stop").item())) for r in pb_utils.bls_requests] == [("7", True)]
    assert waiting.stopped and preprocessing.cancelled and not preprocessing.stopped and not running.stopped
    preprocessing.engine = engine_stream(bls_model, "9")  # its engine request is sent: the next check stops it
    model._check_cancelled()
    assert [r.request_id for r in pb_utils.bls_requests] == ["7", "9"]


def test_a_cancelled_request_the_engine_answered_is_left_to_its_worker(bls, pb_utils):
    """Its worker stops it at the engine's next response. Stopping running requests from the sender thread too
    left the server slow after 20 cancelled streams (tests/integration/test_streaming.py)."""
    bls_model, model = bls
    pb_utils.bls_handler = lambda request: [pb_utils.InferenceResponse()]
    answered = bls_model._Request(pb_utils.ResponseSender(), engine=engine_stream(bls_model, "7"), answered=True)
    answered.sender.cancelled = True
    model._live = {id(answered): answered}
    model._check_cancelled()
    assert answered.cancelled and not answered.stopped and pb_utils.bls_requests == []


def test_a_streamed_delta_carries_only_the_outputs_the_client_asked_for(bls, pb_utils):
    """A client asking for text_output alone with return_log_probs: the ids and log probs stay out (the stub
    would drop them without the GIL, a segfault under Python 3.12)."""
    bls_model, model = bls
    asks_log_probs = SimpleNamespace(delta_tensors=lambda delta: delta.tensors(True, 0))
    state = bls_model._Request(pb_utils.ResponseSender(["text_output"]), {"text_output"}, pipeline=asks_log_probs)
    model._send(state, Delta("café", [5], [-0.5]))
    [(response, flags)] = state.sender.sent
    assert [t.name() for t in response.output_tensors()] == ["text_output"] and flags == 0
    assert response.output_tensors()[0].as_numpy().tolist() == ["café".encode()]


class Pipeline:
    """A stand-in for text/pipeline.StreamedRequest: records what the carrier hands it."""

    def __init__(self, perf: bool = False, stops: bool = False) -> None:
        self.perf, self.stops, self.stopped, self.pushed = perf, stops, False, []

    def engine_inputs(self) -> dict:
        return {"input_ids": np.array([[1, 2]], np.int32)}

    def engine_outputs(self) -> list[str]:
        return ["output_ids", "sequence_length", "output_log_probs", *(KV_CACHE_OUTPUTS if self.perf else ())]

    def push(self, outputs: dict) -> Delta | None:
        self.pushed.append(outputs)
        self.stopped = self.stops
        return Delta("t", outputs["output_ids"].reshape(-1).tolist())


def tokens(pb_utils, *ids: int) -> list:
    return [
        pb_utils.Tensor("output_ids", np.array([[ids]], np.int32)),
        pb_utils.Tensor("sequence_length", np.array([[len(ids)]], np.int32)),
        pb_utils.Tensor("output_log_probs", np.array([[[-0.5] * len(ids)]], np.float32)),
    ]


@pytest.fixture
def engine(bls, pb_utils):
    bls_model, model = bls
    model._ids = itertools.count()
    model.sent = []
    model.outbox = SimpleNamespace(put=lambda state, item: model.sent.append(item))
    return bls_model, model


def test_a_stopped_request_still_gets_the_kv_cache_counts_of_the_engines_last_response(engine, pb_utils):
    """A stop string ends the engine's request early; the counts asked for (return_perf_metrics) come with the
    engine's final response, which the worker drains after stopping it."""
    bls_model, model = engine
    counts = [
        pb_utils.Tensor(name, np.array([[n]], np.int32)) for name, n in zip(KV_CACHE_OUTPUTS, (2, 5, 7), strict=True)
    ]
    pb_utils.bls_handler = lambda request: (
        [pb_utils.InferenceResponse()]
        if request.input("stop") is not None
        else [
            pb_utils.InferenceResponse(tokens(pb_utils, 5)),
            pb_utils.InferenceResponse(tokens(pb_utils, 6)),
            pb_utils.InferenceResponse(counts),
        ]
    )
    stops = Pipeline(perf=True, stops=True)
    perf = model._run_engine(stops, bls_model._Request(pb_utils.ResponseSender()))
    engine_request, stop = pb_utils.bls_requests
    assert set(KV_CACHE_OUTPUTS) <= set(engine_request.requested_output_names) and stop.input("stop") is not None
    assert {name: int(value.item()) for name, value in perf.items()} == dict(
        zip(KV_CACHE_OUTPUTS, (2, 5, 7), strict=True)
    )
    assert len(stops.pushed) == 1, "after the stop, the engine's responses are drained, not streamed"
    pb_utils.bls_requests.clear()
    unasked = model._run_engine(Pipeline(stops=True), bls_model._Request(pb_utils.ResponseSender()))
    assert not set(KV_CACHE_OUTPUTS) & set(pb_utils.bls_requests[0].requested_output_names) and unasked == {}


def test_each_engine_response_reaches_the_pipeline_and_its_delta_the_outbox_in_order(engine, pb_utils):
    bls_model, model = engine
    pb_utils.bls_handler = lambda request: [pb_utils.InferenceResponse(tokens(pb_utils, 10 + i)) for i in range(3)]
    pipeline = Pipeline()
    assert model._run_engine(pipeline, bls_model._Request(pb_utils.ResponseSender())) == {}
    assert [d.ids for d in model.sent] == [[10], [11], [12]]
    assert [sorted(outputs) for outputs in pipeline.pushed] == [
        ["output_ids", "output_log_probs", "sequence_length"]
    ] * 3
    (request,) = pb_utils.bls_requests
    assert request.input("input_ids").tolist() == [[1, 2]]


def test_an_engine_error_after_the_first_response_arrives_in_band_and_fails_the_request(engine, pb_utils):
    """tritonserver 2.51's Python backend never hands an error response that follows another to the BLS iterator:
    the stream waited for ever. Asked with ERRORS_IN_BAND, the engine model sends such an error as GENERATION_ERROR,
    which this model raises with the engine's kind."""
    bls_model, model = engine
    message = "[invalid_input] min_tokens: is 6, but the guide's grammar ends after 1 tokens"
    late = pb_utils.Tensor(GENERATION_ERROR, np.array([[message.encode()]], dtype=object))
    pb_utils.bls_handler = lambda request: [
        pb_utils.InferenceResponse(tokens(pb_utils, 5)),
        pb_utils.InferenceResponse([late]),
    ]
    pipeline = Pipeline()
    with pytest.raises(Exception) as failed:
        model._run_engine(pipeline, bls_model._Request(pb_utils.ResponseSender()))
    (sent,) = pb_utils.bls_requests
    assert GENERATION_ERROR in sent.requested_output_names and sent.input(ERRORS_IN_BAND).tolist() == [[True]]
    assert len(pipeline.pushed) == 1, "the in-band error is not text"
    response = bls_model.error_response(failed.value)
    assert response.error().message() == message and response.error().code() == pb_utils.TritonError.INVALID_ARG


def test_bls_refuses_a_request_past_max_inflight_requests_as_busy(bls, pb_utils):
    """D4: past its worker threads a request waited in the pool's unbounded queue; now it is a 429 at once."""
    import threading

    from tritonllm.backend.admission import BoundedWorkers

    _, model = bls
    model.workers = BoundedWorkers(1, "tensorrt_llm_bls")
    release, reached = threading.Event(), threading.Event()
    model._generate = lambda arrays, state: (reached.set(), release.wait(10))
    text = {"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[4]], np.int32)}
    first, second = pb_utils.Request(dict(text)), pb_utils.Request(dict(text))
    model.execute([first])
    assert reached.wait(10)
    model.execute([second])
    (error,) = second.sender.errors()
    assert ErrorKind.of_message(error.message()) is ErrorKind.BUSY and "max_inflight_requests" in error.message()
    assert second.sender.closed and len(model._live) == 1, "the refused request is not kept"
    release.set()
    model.workers.shutdown()
    assert model.workers.in_flight() == 0
