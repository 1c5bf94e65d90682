"""Unit: the portable engine's Triton adapter (backend.engine_model) answers every request once, on a fake pb_utils.

Admission against the engine's capacity, client cancellation, TensorRT-LLM's `stop` input (also the
health probe), streaming and non-streaming answers, and engine errors, each with the fake engine
below driven by the test.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from tests.polling import eventually
from tests.unit.backend import fake_pb_utils
from tritonllm.engine.adapters import AdapterTable
from tritonllm.engine.api import ENGINE_CONFIG_FILE, Emission, GenerationRequest
from tritonllm.errors import ErrorKind, InputError
from tritonllm.link.engine_calls import EngineSettings
from tritonllm.protocol import (
    ERRORS_IN_BAND,
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_ERROR,
    FINISH_LENGTH,
    GENERATION_ERROR,
    KV_CACHE_OUTPUTS,
    PERF_OUTPUTS,
    lora_admin_tensors,
)
from tritonllm.text.wire import Limits


class FakeEngine:
    """Takes requests and answers them when the test says; `submit` raises for a prompt starting with `refuse`.

    `cancel` is recorded in `cancels`; it ends the request at once (a cancelled emission) unless
    `cancel_ends` is False, as when the engine's loop has not reached it yet: the test then ends it
    with `emit`.
    """

    def __init__(self, refuse: int) -> None:
        self.refuse = refuse
        self.taken: dict[str, tuple[GenerationRequest, Callable[[Emission], None]]] = {}
        self.submitted = 0
        self.cancels: list[str] = []
        self.cancel_ends = True
        self.is_alive = True
        self.warmups: list[GenerationRequest] = []
        self.compiled = threading.Event()
        self.compiled.set()
        self.relayed: list[str] | None = None  # a list: an engine several instances share, relaying stop requests
        self.reporting = True  # whether the model reports the metrics, or forwards its records (to `forwarded`)
        self.forwarded: list = []
        self.adapters = AdapterTable()
        self.step_count: int | None = 0  # steps(): what the health probe reads

    def submit(self, request: GenerationRequest, emit: Callable[[Emission], None]) -> str:
        if request.guide is not None:  # as a real engine compiling a new grammar: until the test says
            assert self.compiled.wait(10)
        if request.input_ids[0] == self.refuse:
            raise RuntimeError("the engine refused this one")
        engine_id = f"e{self.submitted}"
        self.submitted += 1
        self.taken[engine_id] = (request, emit)
        return engine_id

    def emit(self, engine_id: str, emission: Emission) -> None:
        """The engine reports `emission` for one request; a final one ends it."""
        _, emit = self.taken.pop(engine_id) if emission.final else self.taken[engine_id]
        emit(emission)

    def finish_all(self) -> None:
        while self.taken:
            request, emit = self.taken.pop(next(iter(self.taken)))  # finished: a later cancel is a no-op
            emit(Emission(list(range(request.max_new_tokens)), FINISH_LENGTH))

    def cancel(self, engine_id: str) -> None:
        self.cancels.append(engine_id)
        if not self.cancel_ends:
            return
        taken = self.taken.pop(engine_id, None)
        if taken is not None:
            taken[1](Emission([], FINISH_CANCELLED))

    def running(self) -> int:
        return len(self.taken)

    def in_batch(self) -> int:
        return len(self.taken)

    def captured_graphs(self) -> int:
        return 0

    def steps(self) -> int | None:
        return self.step_count

    def relay_stop(self, request_id: str) -> bool:
        if self.relayed is None:
            return False
        self.relayed.append(request_id)
        return True

    def reports_metrics(self) -> bool:
        return self.reporting

    def forward_records(self, records: list) -> None:
        self.forwarded += records

    def alive(self) -> bool:
        return self.is_alive

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> tuple[list[int], str]:
        self.warmups.append(request)
        return [0] * request.max_new_tokens, FINISH_LENGTH

    def shutdown(self) -> None:
        """As the engines' own: the requests it holds fail."""
        self.is_alive = False
        while self.taken:
            _, emit = self.taken.pop(next(iter(self.taken)))
            emit(Emission([], FINISH_ERROR, error="the engine is shutting down"))


class InlineOutbox:
    """Sends at once, on the caller's thread: the order of events is the test's."""

    def __init__(self, send: Callable) -> None:
        self.send = send

    def put(self, call, emission: Emission) -> None:
        self.send(call, emission)

    def close(self) -> None:
        pass  # nothing queued: each emission was sent at once


@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


@pytest.fixture
def model(pb_utils):
    from tritonllm.backend import engine_model

    model = engine_model.EngineModel.__new__(engine_model.EngineModel)  # no engine to load: a fake one
    model.settings = EngineSettings(Limits(max_input_len=8, max_seq_len=16, vocab_size=100), True, 16)
    model.engine = FakeEngine(refuse=7)
    model._health = engine_model.EngineHealth(model.engine)
    model._live = {}
    model._finished = queue.SimpleQueue()
    model._outbox = InlineOutbox(model._send)
    model._guided = ThreadPoolExecutor(engine_model.GUIDED_SUBMITTERS)
    model._compiling = 0
    model._compiling_lock = threading.Lock()
    model._unloading = False
    model._admin = engine_model.AdapterAdmin(model.engine)
    model._administrators = ThreadPoolExecutor(1)
    yield model
    model._guided.shutdown()
    model._administrators.shutdown()


def request(pb_utils, *prompts: list[int], request_id: str = "", requested: list[str] | None = None, **extra):
    """A `tensorrt_llm` request of one row per prompt, 3 tokens to generate each, with `extra` inputs, asking for
    the `requested` outputs (default: all)."""
    ids = np.asarray(prompts, dtype=np.int32)
    inputs = {
        "input_ids": ids,
        "input_lengths": np.full((len(prompts),), ids.shape[1], dtype=np.int32),
        "request_output_len": np.full((len(prompts),), 3, dtype=np.int32),
        **extra,
    }
    return pb_utils.Request(inputs, request_id=request_id, requested=requested)


def stop_request(pb_utils, request_id: str):
    """TensorRT-LLM's `stop` request, with the inputs the health probe sends (tritonllm.launch.tritonserver)."""
    one = np.ones((1, 1), dtype=np.int32)
    inputs = {"input_ids": one, "input_lengths": one, "request_output_len": one, "stop": np.array([[True]])}
    return pb_utils.Request(inputs, request_id=request_id)


def output_ids(pb_utils, response) -> list:
    return pb_utils.get_output_tensor_by_name(response, "output_ids").as_numpy().tolist()


def finals(pb_utils, sender) -> int:
    return sum(1 for _, flags in sender.sent if flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


STREAMING = {"streaming": np.array([[True]])}


def test_a_request_the_engine_refuses_fails_alone(model, pb_utils):
    batch = [request(pb_utils, [1, 2]), request(pb_utils, [7, 2]), request(pb_utils, [3, 4])]
    model.execute(batch)
    model.engine.finish_all()
    ok, refused, ok_too = (r.sender.sent for r in batch)
    for sent in (ok, ok_too):
        [(response, flags)] = sent
        assert flags == pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL and not response.has_error()
        assert pb_utils.get_output_tensor_by_name(response, "output_ids").as_numpy().tolist() == [[[0, 1, 2]]]
    [(response, flags)] = refused
    assert flags == pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert "the engine refused this one" in response.error().message()
    assert model._live == {}


def test_a_refused_row_ends_its_whole_request_once(model, pb_utils):
    """The rows the engine took before are cancelled; the request gets one final response, the error."""
    batched = request(pb_utils, [1, 2], [7, 2])
    model.execute([batched])
    assert model.engine.running() == 0, "the taken row was cancelled"
    [(response, flags)] = batched.sender.sent
    assert flags == pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response.has_error()
    assert model._live == {}


FINAL = fake_pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def test_an_error_is_counted_under_the_kind_it_is_answered_with(model, pb_utils, monkeypatch):
    """A client's mistake is invalid_input (INVALID_ARG); a bug while parsing is answered INTERNAL and counted as a
    failure, not as the client's fault."""
    bad = request(pb_utils, [1, 2], request_output_len=np.array([0], np.int32))
    model.execute([bad])
    [(response, _)] = bad.sender.sent
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert drain(model._finished) == ["invalid_input"]
    from tritonllm.link import engine_calls

    monkeypatch.setattr(engine_calls, "parse_requests", lambda arrays, limits, adapters: {}["a bug"])
    buggy = request(pb_utils, [1, 2])
    model.execute([buggy])
    [(response, _)] = buggy.sender.sent
    assert response.error().code() == pb_utils.TritonError.INTERNAL
    assert drain(model._finished) == ["generation_failed"]


# Admission: requests beyond max_batch_size running + max_queue_size waiting are refused as busy.


def test_a_request_over_the_engines_capacity_is_refused_as_busy(model, pb_utils):
    full = [request(pb_utils, [1, 2]) for _ in range(model.settings.capacity - 1)]
    model.execute(full)
    last_seat = request(pb_utils, [1, 2])
    model.execute([last_seat])  # capacity - 1 in the engine: still admitted
    assert last_seat.sender.sent == [] and model.engine.running() == model.settings.capacity

    over = request(pb_utils, [1, 2])
    model.execute([over])
    [(response, flags)] = over.sender.sent
    assert flags == FINAL
    error = response.error()
    assert error.code() == pb_utils.TritonError.UNAVAILABLE
    assert error.message().startswith(f"{ErrorKind.BUSY.tag} ")
    assert f"its limit is {model.settings.capacity}" in error.message() and "max_queue_size" in error.message()
    assert model.engine.running() == model.settings.capacity, "nothing of the refused request reached the engine"
    assert "server_busy" in drain(model._finished)
    assert all(r.sender.sent == [] for r in [*full, last_seat])


def test_admission_counts_a_batched_requests_rows(model, pb_utils):
    model.execute([request(pb_utils, [1, 2]) for _ in range(model.settings.capacity - 1)])
    two_rows = request(pb_utils, [1, 2], [3, 4])
    model.execute([two_rows])  # one seat left, two rows
    [(response, flags)] = two_rows.sender.sent
    assert flags == FINAL and ErrorKind.of_message(response.error().message()) is ErrorKind.BUSY
    one_row = request(pb_utils, [1, 2])
    model.execute([one_row])
    assert one_row.sender.sent == [] and model.engine.running() == model.settings.capacity


def test_a_seat_freed_by_a_finished_request_is_taken_again(model, pb_utils):
    model.execute([request(pb_utils, [1, 2]) for _ in range(model.settings.capacity)])
    model.engine.emit("e0", Emission([5], FINISH_EOS))
    again = request(pb_utils, [1, 2])
    model.execute([again])
    assert again.sender.sent == [] and model.engine.running() == model.settings.capacity


# Cancellation: the sender thread's periodic check cancels what the client gave up.


def test_a_cancelled_request_is_cancelled_in_the_engine_by_the_periodic_check_and_ends_once(model, pb_utils):
    cancelled, kept = request(pb_utils, [1, 2]), request(pb_utils, [3, 4], **STREAMING)
    model.execute([cancelled, kept])
    cancelled.sender.cancelled = True
    assert model.engine.cancels == [], "nothing is cancelled before the check"
    model._check_cancelled()
    assert set(model.engine.cancels) == {"e0"}  # once by the check, once more (a no-op) as the call closes
    [(response, flags)] = cancelled.sender.sent
    assert flags == FINAL and not response.has_error()
    assert pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().tolist() == [[0]]
    calls = len(model.engine.cancels)
    model._check_cancelled()
    assert len(model.engine.cancels) == calls, "an ended request is not cancelled again"
    assert finals(pb_utils, cancelled.sender) == 1
    assert kept.sender.sent == [] and model.engine.running() == 1


def test_a_cancelled_request_the_engine_ends_later_still_gets_one_final_response(model, pb_utils):
    """The engine's loop ends a cancelled request at its next step: checks until then ask again, harmlessly."""
    model.engine.cancel_ends = False
    cancelled = request(pb_utils, [1, 2], **STREAMING)
    model.execute([cancelled])
    model.engine.emit("e0", Emission([5]))
    cancelled.sender.cancelled = True
    model._check_cancelled()
    model._check_cancelled()
    assert set(model.engine.cancels) == {"e0"} and finals(pb_utils, cancelled.sender) == 0
    model.engine.emit("e0", Emission([6], FINISH_CANCELLED))  # with the tokens generated until then
    model._check_cancelled()
    calls = len(model.engine.cancels)
    model._check_cancelled()
    assert len(model.engine.cancels) == calls, "the ended request is no longer checked"
    assert [output_ids(pb_utils, r) for r, _ in cancelled.sender.sent] == [[[[5]]], [[[6]]]]
    assert [flags for _, flags in cancelled.sender.sent] == [0, FINAL]


@pytest.fixture
def started(pb_utils, monkeypatch, tmp_path, request):
    """An EngineModel through `initialize`, with its real sender thread, on a fake engine in place of EngineProcess
    (one that reports the metrics unless the test's parameter says False)."""
    from tritonllm.backend import engine_model

    engine = FakeEngine(refuse=7)
    engine.reporting = getattr(request, "param", True)

    def shared(config, shared_as: str, on_stop, on_records):
        engine.shared_as, engine.on_stop, engine.on_records = shared_as, on_stop, on_records
        return engine

    monkeypatch.setattr(engine_model, "EngineProcess", shared)
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / ENGINE_CONFIG_FILE).write_text(json.dumps({"model_dir": "unused", "engine_process": True}))
    config = {
        "max_batch_size": 2,
        "model_transaction_policy": {"decoupled": True},
        "parameters": {
            name: {"string_value": value}
            for name, value in {
                "max_input_len": "8",
                "max_seq_len": "16",
                "vocab_size": "100",
                "max_queue_size": "1",
                "exclude_input_in_output": "true",
            }.items()
        },
    }
    model = engine_model.EngineModel()
    args = {"model_config": json.dumps(config), "model_repository": str(tmp_path), "model_version": "1"}
    model.initialize({**args, "model_name": "tensorrt_llm"})
    yield model
    model.finalize()


def test_capacity_is_max_batch_size_plus_max_queue_size(started, pb_utils):
    assert started.settings.capacity == 3 and len(started.engine.warmups) == 1
    admitted = [request(pb_utils, [1, 2]) for _ in range(3)]
    started.execute(admitted)
    over = request(pb_utils, [1, 2])
    started.execute([over])
    assert started.engine.running() == 3 and all(r.sender.sent == [] for r in admitted)
    [(response, flags)] = over.sender.sent
    assert flags == FINAL and response.error().code() == pb_utils.TritonError.UNAVAILABLE
    assert response.error().message().startswith(ErrorKind.BUSY.tag) and "its limit is 3" in response.error().message()


def test_the_sender_thread_checks_for_cancelled_requests(started, pb_utils):
    cancelled = request(pb_utils, [1, 2])
    started.execute([cancelled])
    cancelled.sender.cancelled = True
    assert eventually(lambda: cancelled.sender.closed), "the periodic check never cancelled the request"
    assert started.engine.cancels[0] == "e0" and set(started.engine.cancels) == {"e0"}
    time.sleep(3 * 0.2)  # a few more periods: no second answer
    assert finals(pb_utils, cancelled.sender) == 1 and len(cancelled.sender.sent) == 1


# TensorRT-LLM's `stop` input: end the running requests with that request id.


def test_a_stop_request_ends_the_running_request_with_its_id(model, pb_utils):
    stopped = request(pb_utils, [1, 2], [3, 4], request_id="r1")  # two rows: both end
    other = request(pb_utils, [5, 6], request_id="r2", **STREAMING)
    model.execute([stopped, other])
    stop = stop_request(pb_utils, "r1")
    model.execute([stop])
    assert set(model.engine.cancels) == {"e0", "e1"}
    assert stop.sender.sent == [(None, FINAL)]
    # The engine ended both rows: a response for each, the last one FINAL.
    assert [flags for _, flags in stopped.sender.sent] == [0, FINAL]
    assert not any(response.has_error() for response, _ in stopped.sender.sent)
    assert other.sender.sent == [] and model.engine.running() == 1 and "e2" in model.engine.taken


def test_a_stop_request_reaches_every_instance_sharing_the_engine(started, pb_utils, tmp_path):
    """With the engine in a process of its own, the instances of the engine model on one server share it, and a stop
    request, which reaches one of them, ends the calls of every one: the engine relays it to each (`on_stop`)."""
    engine = started.engine
    # The host (a container's own), the server's process and the model's folder.
    assert engine.shared_as == f"{socket.gethostname()}:{os.getppid()}:{tmp_path.resolve() / '1'}"
    engine.relayed = []
    running = request(pb_utils, [1, 2], request_id="r1")
    started.execute([running])
    stop = stop_request(pb_utils, "r1")
    started.execute([stop])
    assert engine.relayed == ["r1"] and engine.cancels == [] and stop.sender.sent == [(None, FINAL)]
    engine.on_stop("r1")  # the relayed stop, as every sharing instance gets it
    assert engine.cancels == ["e0"]
    assert eventually(lambda: [flags for _, flags in running.sender.sent] == [FINAL])


@pytest.mark.parametrize("started", [False], indirect=True)
def test_an_instance_that_does_not_report_the_metrics_forwards_its_records(started, pb_utils):
    """Of the instances sharing an engine, one registers and reports the metrics (in tritonserver 2.51 a metric two
    stubs register is one, freed by either while the other updates it); the others forward their records."""
    over = [request(pb_utils, [1, 2]) for _ in range(4)]  # capacity 3: the fourth is refused, busy
    started.execute(over)
    started._update_metrics()  # or its sender's periodic tick does
    assert eventually(lambda: started.engine.forwarded == ["server_busy"])
    assert started.metrics is None and pb_utils.metric_families == []  # registered none


def test_the_reporting_instance_counts_the_records_others_forwarded(started, pb_utils):
    started.engine.on_records(["server_busy", "server_busy"])  # relayed by the engine's process
    started._update_metrics()  # or its sender's periodic tick does
    (busy,) = [m for m in started.metrics.errors.values() if m.labels["kind"] == "server_busy"]
    assert eventually(lambda: busy.value() == 2) and started.engine.forwarded == []


def test_a_stop_request_ends_a_stream_after_the_tokens_it_got(model, pb_utils):
    stream = request(pb_utils, [1, 2], request_id="r1", **STREAMING)
    model.execute([stream])
    model.engine.emit("e0", Emission([5]))
    model.execute([stop_request(pb_utils, "r1")])
    assert set(model.engine.cancels) == {"e0"}
    assert [flags for _, flags in stream.sender.sent] == [0, FINAL]
    assert stream.sender.sent[-1][0] is None, "the cancelled emission had no tokens: an empty final response"


def test_a_stop_for_an_unknown_id_is_answered_at_once(model, pb_utils):
    """What the health probe sends (tritonllm.launch.tritonserver.probe_engine): it must not wait for anything."""
    running = request(pb_utils, [1, 2], request_id="r1")
    model.execute([running])
    probe = stop_request(pb_utils, "tritonllm-health-probe")
    model.execute([probe])
    assert probe.sender.sent == [(None, FINAL)]
    assert model.engine.cancels == [] and running.sender.sent == [] and model.engine.running() == 1


def test_the_health_probe_fails_for_a_busy_engine_whose_steps_stopped(model, pb_utils):
    """A wedged step leaves the engine's threads alive: the probe tells it by the step count (engine/health.py)."""
    model.execute([request(pb_utils, [1, 2], request_id="r1")])
    model._health.stalled_after = 0.05
    answers = []
    for steps in (3, 3, 4, 4):  # the clock starts at a count; a new count restarts it
        probe = stop_request(pb_utils, "tritonllm-health-probe")
        model.engine.step_count = steps
        model.execute([probe])
        answers.append(probe.sender.sent)
        time.sleep(0.1)
    assert answers[0] == answers[2] == [(None, FINAL)]
    for sent in answers[1], answers[3]:
        [(response, flags)] = sent
        assert flags == FINAL and response.error().code() == pb_utils.TritonError.INTERNAL
        assert "finished no step" in response.error().message()


def test_the_health_probe_of_an_idle_engine_generates_a_token(model, pb_utils):
    probe = stop_request(pb_utils, "tritonllm-health-probe")
    model._health.generation_timeout = 0.05
    model.execute([probe])  # the fake engine takes the probe's generation and never answers it
    [(response, flags)] = probe.sender.sent
    assert flags == FINAL and "generated no token" in response.error().message()
    assert model.engine.cancels == ["e0"]


def lora_action(model, pb_utils, action: str, **extra):
    """A lora_action request's one response, once its administrator thread sent it."""
    tensors = lora_admin_tensors(action, **extra)
    admin = pb_utils.Request({name: value for name, value, _ in tensors})
    model.execute([admin])
    assert eventually(lambda: admin.sender.sent, timeout=10)
    [(response, flags)] = admin.sender.sent
    assert flags == FINAL
    return response


def test_lora_actions_list_and_refuse_changes_without_an_adapter_folder(model, pb_utils):
    """`list` answers on any build (no adapters here, nothing generated); load and unload need --lora-dir, and an
    unknown action is refused by name."""
    listing = lora_action(model, pb_utils, "list")
    assert json.loads(pb_utils.get_output_tensor_by_name(listing, "lora_adapters").as_numpy().reshape(-1)[0]) == []
    for action, extra in (("load", {"name": "a", "path": "a"}), ("unload", {"name": "a"})):
        error = lora_action(model, pb_utils, action, **extra).error()
        assert error.code() == pb_utils.TritonError.INVALID_ARG and "--lora-dir" in error.message()
    error = lora_action(model, pb_utils, "reload").error()
    assert "lora_action: `reload` is not one of load, unload, list" in error.message()
    assert model.engine.submitted == 0  # nothing was generated


def test_a_stop_without_a_request_id_is_invalid_input(model, pb_utils):
    model.execute([request(pb_utils, [1, 2])])  # a request without an id is not stopped either
    stop = stop_request(pb_utils, "")
    model.execute([stop])
    [(response, flags)] = stop.sender.sent
    assert flags == FINAL and response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert ErrorKind.of_message(response.error().message()) is ErrorKind.INVALID_INPUT
    assert "stop" in response.error().message() and model.engine.cancels == []


def test_a_stop_fails_when_the_engines_loop_has_stopped(model, pb_utils):
    """So the health probe reports a dead engine instead of a healthy one."""
    model.engine.is_alive = False
    probe = stop_request(pb_utils, "tritonllm-health-probe")
    model.execute([probe])
    [(response, flags)] = probe.sender.sent
    assert flags == FINAL and response.error().code() == pb_utils.TritonError.INTERNAL
    assert "stopped" in response.error().message()


# Streaming or not: one response with all the tokens, or one per emission; the final flag on the last.


def test_a_non_streaming_request_gets_one_response_with_all_its_tokens(model, pb_utils):
    call = request(pb_utils, [1, 2])
    model.execute([call])
    model.engine.emit("e0", Emission([5, 6, 7], FINISH_LENGTH))
    [(response, flags)] = call.sender.sent
    assert flags == FINAL and output_ids(pb_utils, response) == [[[5, 6, 7]]]
    assert pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().tolist() == [[3]]
    assert model._live == {}


def test_a_non_streaming_request_can_ask_for_its_input_in_the_output(model, pb_utils):
    call = request(pb_utils, [1, 2], exclude_input_in_output=np.array([[False]]))
    model.execute([call])
    model.engine.emit("e0", Emission([5], FINISH_EOS))
    [(response, flags)] = call.sender.sent
    assert flags == FINAL and output_ids(pb_utils, response) == [[[1, 2, 5]]]


def test_a_batched_request_gets_a_response_per_row_the_last_final(model, pb_utils):
    """As TensorRT-LLM's backend in decoupled mode: each row answered when it ends, with its batch_index."""
    call = request(pb_utils, [1, 2], [3, 4], pad_id=np.array([[9]], dtype=np.int32))
    model.execute([call])
    model.engine.emit("e1", Emission([5, 6], FINISH_LENGTH))
    [(first, flags)] = call.sender.sent
    assert flags == 0 and output_ids(pb_utils, first) == [[[5, 6]]]
    assert pb_utils.get_output_tensor_by_name(first, "batch_index").as_numpy().tolist() == [[1]]
    model.engine.emit("e0", Emission([7], FINISH_EOS))
    (last, flags) = call.sender.sent[-1]
    assert flags == FINAL and output_ids(pb_utils, last) == [[[7]]]
    assert pb_utils.get_output_tensor_by_name(last, "batch_index").as_numpy().tolist() == [[0]]
    assert pb_utils.get_output_tensor_by_name(last, "sequence_length").as_numpy().tolist() == [[1]]


def test_num_return_sequences_answer_a_response_per_sequence(model, pb_utils):
    call = request(pb_utils, [1, 2], num_return_sequences=np.array([[2]], np.int32), **STREAMING)
    model.execute([call])
    model.engine.emit("e1", Emission([5]))
    model.engine.emit("e0", Emission([6], FINISH_LENGTH))
    model.engine.emit("e1", Emission([], FINISH_LENGTH))
    indices = [
        int(pb_utils.get_output_tensor_by_name(r, "sequence_index").as_numpy()[0, 0])
        for r, _ in call.sender.sent
        if r is not None
    ]
    assert indices == [1, 0] and call.sender.sent[-1][1] == FINAL


def test_a_streaming_request_gets_a_response_per_emission_and_the_final_flag_on_the_last(model, pb_utils):
    stream = request(pb_utils, [1, 2], **STREAMING)
    model.execute([stream])
    model.engine.emit("e0", Emission([5]))
    model.engine.emit("e0", Emission([6, 7]))
    assert [flags for _, flags in stream.sender.sent] == [0, 0]
    model.engine.emit("e0", Emission([8], FINISH_LENGTH))
    assert [output_ids(pb_utils, r) for r, _ in stream.sender.sent] == [[[[5]]], [[[6, 7]]], [[[8]]]]
    assert [flags for _, flags in stream.sender.sent] == [0, 0, FINAL]
    assert model._live == {}


def test_a_stream_that_ends_without_new_tokens_gets_an_empty_final_response(model, pb_utils):
    stream = request(pb_utils, [1, 2], **STREAMING)
    model.execute([stream])
    model.engine.emit("e0", Emission([5]))
    model.engine.emit("e0", Emission([], FINISH_EOS))
    assert [flags for _, flags in stream.sender.sent] == [0, FINAL]
    assert stream.sender.sent[-1][0] is None


def test_a_response_carries_only_the_outputs_its_request_asked_for(model, pb_utils):
    # tensorrt_llm_bls asks for output_ids and sequence_length and passes return_num_output_tokens on: the
    # stub would drop num_output_tokens without the GIL (a segfault under Python 3.12).
    counts = {"return_num_output_tokens": np.array([[True]])}
    stream = request(pb_utils, [1, 2], requested=["output_ids", "sequence_length"], **counts, **STREAMING)
    model.execute([stream])
    model.engine.emit("e0", Emission([5]))
    model.engine.emit("e0", Emission([6], FINISH_LENGTH))
    assert [sorted(t.name() for t in r.output_tensors()) for r, _ in stream.sender.sent] == [
        ["output_ids", "sequence_length"]
    ] * 2
    everything = request(pb_utils, [1, 2], **counts, **STREAMING)
    model.execute([everything])
    model.engine.emit("e1", Emission([6], FINISH_LENGTH))
    [(response, _)] = everything.sender.sent
    assert pb_utils.get_output_tensor_by_name(response, "num_output_tokens").as_numpy().tolist() == [[1]]


def kv_cache(pb_utils, response) -> list:
    """(new, reused, total) blocks per row, from TensorRT-LLM's return_perf_metrics outputs."""
    columns = [pb_utils.get_output_tensor_by_name(response, name).as_numpy().reshape(-1) for name in KV_CACHE_OUTPUTS]
    return [tuple(int(c[row]) for c in columns) for row in range(len(columns[0]))]


PERF = {"return_perf_metrics": np.array([[True]])}


def perf(pb_utils, response, name: str) -> list:
    return pb_utils.get_output_tensor_by_name(response, name).as_numpy().reshape(-1).tolist()


def test_a_stream_asking_for_perf_metrics_gets_them_in_every_response(model, pb_utils):
    """As TensorRT-LLM's executor, which sets requestPerfMetrics on each result of such a request: all ten outputs,
    the counts and times so far; at the end, the engine's own times and the cells taken from the prefix cache."""
    stream = request(pb_utils, [1, 2, 3, 4], **PERF, **STREAMING)
    model.execute([stream])
    model.engine.emit("e0", Emission([5]))
    model.engine.emit("e0", Emission([6, 7], FINISH_LENGTH, time_to_first_token=0.5, cached_tokens=3))
    first, (last, _) = stream.sender.sent[0][0], stream.sender.sent[-1]
    for response in (first, last):
        assert {t.name() for t in response.output_tensors()} >= set(PERF_OUTPUTS)
        assert perf(pb_utils, response, "acceptance_rate") == [0.0]
        assert perf(pb_utils, response, "total_draft_tokens") == perf(pb_utils, response, "total_accepted_draft_tokens")
        assert perf(pb_utils, response, "total_draft_tokens") == [0]
    arrival = perf(pb_utils, first, "arrival_time_ns")[0]
    first_token, last_token = (
        perf(pb_utils, first, "first_token_time_ns")[0],
        perf(pb_utils, first, "last_token_time_ns")[0],
    )
    assert 0 < arrival <= first_token <= last_token
    assert perf(pb_utils, last, "arrival_time_ns") == [arrival]
    # The engine's first token came 0.5 s after the request was handed to it.
    assert perf(pb_utils, last, "first_token_time_ns")[0] - arrival == pytest.approx(0.5e9, abs=0.1e9)
    assert perf(pb_utils, last, "first_scheduled_time_ns") == [0], "an engine that does not say when: 0, unset"
    # 4 prompt cells (3 of them an earlier request's) and one per generated token but the last: 4 + 2.
    assert kv_cache(pb_utils, last) == [(3, 3, 6)]
    ended = request(pb_utils, [1, 2], **PERF, **STREAMING)
    model.execute([ended])
    model.engine.emit("e1", Emission([], FINISH_EOS, time_to_schedule=0.01))
    [(response, flags)] = ended.sender.sent
    assert flags == FINAL and kv_cache(pb_utils, response) == [(2, 0, 2)], "a final response without tokens too"
    assert perf(pb_utils, response, "first_token_time_ns") == [0], "no token: no time"
    assert perf(pb_utils, response, "first_scheduled_time_ns")[0] > 0


def test_a_batched_request_gets_each_rows_kv_cache_counts_and_none_unasked(model, pb_utils):
    call = request(pb_utils, [1, 2], [3, 4], **PERF)
    model.execute([call])
    model.engine.emit("e0", Emission([5, 6, 7], FINISH_LENGTH, cached_tokens=1))
    model.engine.emit("e1", Emission([8], FINISH_EOS))
    assert [kv_cache(pb_utils, response) for response, _ in call.sender.sent] == [[(3, 1, 4)], [(2, 0, 2)]]
    plain = request(pb_utils, [1, 2])
    model.execute([plain])
    model.engine.emit("e2", Emission([5], FINISH_EOS, cached_tokens=1))
    assert pb_utils.get_output_tensor_by_name(plain.sender.sent[0][0], "kv_cache_reused_blocks") is None


# Errors: an engine error ends the request with a tagged INTERNAL error, once.


def test_an_engine_error_ends_a_request_with_an_internal_error(model, pb_utils):
    call = request(pb_utils, [1, 2])
    model.execute([call])
    model.engine.emit("e0", Emission([], FINISH_ERROR, error="CUDA error: out of memory"))
    [(response, flags)] = call.sender.sent
    assert flags == FINAL
    error = response.error()
    assert error.code() == pb_utils.TritonError.INTERNAL
    assert error.message().startswith(f"{ErrorKind.INTERNAL.tag} ")
    assert ErrorKind.of_message(error.message()) is ErrorKind.INTERNAL
    assert "CUDA error: out of memory" in error.message()
    assert pb_utils.Logger.errors() == [], "an engine failure is not a bug of the adapter: no traceback logged"
    assert model._live == {}


def test_a_clients_mistake_the_engine_finds_late_is_invalid_input_not_internal(model, pb_utils):
    """min_tokens past a guide's end shows only while generating: the engine says so by the error's kind."""
    call = request(pb_utils, [1, 2])
    model.execute([call])
    refusal = "min_tokens: is 6, but the guide's grammar ends after 1 tokens"
    model.engine.emit("e0", Emission([], FINISH_ERROR, error=refusal, error_kind=ErrorKind.INVALID_INPUT))
    [(response, flags)] = call.sender.sent
    error = response.error()
    assert flags == FINAL and error.code() == pb_utils.TritonError.INVALID_ARG
    assert error.message() == f"{ErrorKind.INVALID_INPUT.tag} {refusal}"
    assert model._live == {}


def test_an_engine_error_ends_a_stream_after_its_tokens(model, pb_utils):
    stream = request(pb_utils, [1, 2], **STREAMING)
    model.execute([stream])
    model.engine.emit("e0", Emission([5]))
    _, late = model.engine.taken["e0"]
    model.engine.emit("e0", Emission([], FINISH_ERROR, error="boom"))
    assert [flags for _, flags in stream.sender.sent] == [0, FINAL]
    assert ErrorKind.of_message(stream.sender.sent[-1][0].error().message()) is ErrorKind.INTERNAL
    late(Emission([6], FINISH_CANCELLED))  # an emission racing the end (a cancel's): the request is answered already
    assert len(stream.sender.sent) == 2


def test_a_late_error_goes_in_band_where_the_request_asks(model, pb_utils):
    """tensorrt_llm_bls asks (errors_in_band): through BLS, tritonserver 2.51 loses an error response that follows
    another. A client that does not ask gets the error response, whatever outputs it names."""
    in_band = {ERRORS_IN_BAND: np.array([[True]])}
    stream = request(pb_utils, [1, 2], **STREAMING, **in_band)
    model.execute([stream])
    model.engine.emit("e0", Emission([5]))
    model.engine.emit("e0", Emission([], FINISH_ERROR, error="boom"))
    (first, _), (last, flags) = stream.sender.sent
    assert not first.has_error() and not last.has_error() and flags == FINAL
    message = pb_utils.get_output_tensor_by_name(last, GENERATION_ERROR).as_numpy().reshape(-1)[0].decode()
    assert message.startswith(ErrorKind.INTERNAL.tag) and "boom" in message
    first_error = request(pb_utils, [1, 2], **STREAMING, **in_band)
    model.execute([first_error])
    model.engine.emit("e1", Emission([], FINISH_ERROR, error="boom"))
    [(response, _)] = first_error.sender.sent
    assert response.has_error(), "a first response is delivered either way: a plain error"
    plain = request(pb_utils, [1, 2], requested=["output_ids", GENERATION_ERROR], **STREAMING)
    model.execute([plain])
    model.engine.emit("e2", Emission([5]))
    model.engine.emit("e2", Emission([], FINISH_ERROR, error="boom"))
    assert plain.sender.sent[-1][0].has_error()


def test_an_engine_error_in_one_row_ends_the_whole_request_once(model, pb_utils):
    call = request(pb_utils, [1, 2], [3, 4])
    model.execute([call])
    model.engine.emit("e1", Emission([], FINISH_ERROR, error="boom"))
    assert "e0" in model.engine.cancels, "the other row is cancelled, freeing its batch slot"
    [(response, flags)] = call.sender.sent
    assert flags == FINAL and response.error().code() == pb_utils.TritonError.INTERNAL
    assert model._live == {} and model.engine.running() == 0


def drain(records: queue.SimpleQueue) -> list:
    out = []
    while not records.empty():
        out.append(records.get())
    return out


def test_a_request_parameter_no_model_reads_is_refused_by_name(pb_utils):
    """HTTP /generate turns keys that are not inputs into request parameters."""
    from tritonllm.backend.triton_glue import input_arrays

    request = fake_pb_utils.Request({"x": np.zeros(1)}, parameters={"sequence_id": 0, "lora_task_id": 3})
    with pytest.raises(InputError) as err:
        input_arrays(request)
    assert err.value.field == "lora_task_id"
    assert set(input_arrays(fake_pb_utils.Request({"x": np.zeros(1)}, parameters={"priority": 1}))) == {"x"}


def test_num_output_tokens_counts_the_output_ids_as_tensorrt_llm_does(model, pb_utils):
    """fillTritonResponse writes the size of the output ids it returns: the prompt's too in a whole answer that
    includes it (exclude_input_in_output false), each response's own when streaming."""
    counts = {"return_num_output_tokens": np.array([[True]]), "return_num_input_tokens": np.array([[True]])}
    whole = request(pb_utils, [1, 2, 3], exclude_input_in_output=np.array([[False]]), **counts)
    model.execute([whole])
    model.engine.emit("e0", Emission([5, 6], FINISH_EOS))
    [(response, _)] = whole.sender.sent
    count = pb_utils.get_output_tensor_by_name(response, "num_output_tokens").as_numpy()
    assert output_ids(pb_utils, response) == [[[1, 2, 3, 5, 6]]] and count.tolist() == [[5]]
    stream = request(pb_utils, [1, 2, 3], **counts, **STREAMING)
    model.execute([stream])
    model.engine.emit("e1", Emission([5]))
    model.engine.emit("e1", Emission([6, 7], FINISH_LENGTH))
    per_response = [
        pb_utils.get_output_tensor_by_name(r, "num_output_tokens").as_numpy().tolist() for r, _ in stream.sender.sent
    ]
    assert per_response == [[[1]], [[2]]]


# A guided request's grammar compiles in the engine's `submit`, which can take seconds: not on Triton's thread.

GUIDED = {
    "guided_decoding_guide_type": np.array([[b"regex"]], dtype=object),
    "guided_decoding_guide": np.array([[b"[0-9]+"]], dtype=object),
}


def test_a_compiling_guide_holds_up_neither_other_requests_nor_stops(model, pb_utils):
    model.engine.compiled.clear()
    guided = request(pb_utils, [1, 2], request_id="g", **GUIDED)
    model.execute([guided])  # returns while the grammar compiles
    plain = request(pb_utils, [3, 4])
    model.execute([plain])
    assert [r.input_ids for r, _ in model.engine.taken.values()] == [[3, 4]]
    assert model._compiling == 1  # admission counts the row waiting on its grammar
    stop = stop_request(pb_utils, "g")
    model.execute([stop])
    assert finals(pb_utils, stop.sender) == 1
    model.engine.compiled.set()  # compiled: handed to the engine, and ended at once, as the stop asked
    assert eventually(lambda: guided.sender.closed)
    model._guided.shutdown()
    assert model._compiling == 0 and set(model.engine.cancels) == {"e1"}
    assert finals(pb_utils, guided.sender) == 1 and model.engine.running() == 1


def test_a_guided_request_the_engine_refuses_fails_alone(model, pb_utils):
    refused = request(pb_utils, [7, 2], **GUIDED)
    model.execute([refused])
    model._guided.shutdown()
    [(response, flags)] = refused.sender.sent
    assert flags == FINAL and "refused this one" in response.error().message() and model._compiling == 0


def test_a_guided_refusal_is_sent_by_the_outbox_not_the_submitter(model, pb_utils):
    """The outbox's thread asks calls whether they were cancelled; a final response sent meanwhile from another
    thread is what makes tritonserver 2.51 read a freed response factory. So every response leaves from it."""
    queued: list = []
    model._outbox = SimpleNamespace(put=lambda key, item: queued.append((key, item)))
    refused = request(pb_utils, [7, 2], **GUIDED)
    model.execute([refused])
    model._guided.shutdown()
    assert refused.sender.sent == [] and len(queued) == 1, "sent on the submitter's thread"
    model._send(*queued[0])
    [(response, flags)] = refused.sender.sent
    assert flags == FINAL and "refused this one" in response.error().message() and model._live == {}


def test_guided_calls_queued_at_unload_each_get_a_final_error(model, pb_utils, monkeypatch):
    """Unloaded while grammars compile: the calls queued behind the submitters are refused, those that reached the
    engine fail with its shutdown; none is left without its final response."""
    from tritonllm.backend import engine_model

    model.engine.compiled.clear()
    calls = [request(pb_utils, [1, 2], **GUIDED) for _ in range(engine_model.GUIDED_SUBMITTERS + 2)]
    model.execute(calls)
    shutdown = model._guided.shutdown

    def shutdown_then_compile(wait: bool = True, *, cancel_futures: bool = False) -> None:
        shutdown(wait=False, cancel_futures=cancel_futures)  # at least two calls are still queued
        model.engine.compiled.set()  # the grammars compiling meanwhile are ready
        shutdown(wait=wait)

    monkeypatch.setattr(model._guided, "shutdown", shutdown_then_compile)
    model.finalize()
    assert [finals(pb_utils, call.sender) for call in calls] == [1] * len(calls)
    assert all(len(call.sender.sent) == 1 and call.sender.errors() for call in calls)
    messages = [call.sender.errors()[0].message() for call in calls]
    assert sum("the model is being unloaded" in message for message in messages) >= 2
    assert model._live == {} and model._compiling == 0


def test_a_final_response_that_fails_to_build_ends_its_call_with_an_error(started, pb_utils, monkeypatch):
    """The outbox only logs what its sender raises: the client would wait for a final response forever. The other
    calls go on."""
    from tritonllm.link import engine_calls

    broken, other = request(pb_utils, [1, 2], **STREAMING), request(pb_utils, [3, 4], **STREAMING)
    started.execute([broken, other])
    pack = engine_calls.pack_outputs

    def pack_but_not_six(tokens: list, *args, **kwargs) -> dict:
        if 6 in tokens[0]:  # the final emission's, joined to the one before or not
            raise ValueError("a bug packing outputs")
        return pack(tokens, *args, **kwargs)

    monkeypatch.setattr(engine_calls, "pack_outputs", pack_but_not_six)
    started.engine.emit("e0", Emission([5]))
    started.engine.emit("e0", Emission([6], FINISH_LENGTH))
    started.engine.emit("e1", Emission([7], FINISH_LENGTH))
    assert eventually(lambda: broken.sender.closed and other.sender.closed)
    assert finals(pb_utils, broken.sender) == 1 and broken.sender.sent[-1][1] == FINAL
    [error] = broken.sender.errors()
    assert error.code() == pb_utils.TritonError.INTERNAL and "a bug packing outputs" in error.message()
    assert any("a bug packing outputs" in logged for logged in pb_utils.Logger.errors()), "a bug: its traceback"
    [(response, flags)] = other.sender.sent
    assert flags == FINAL and output_ids(pb_utils, response) == [[[7]]]
    assert started._live == {}


def test_a_response_that_fails_to_send_ends_its_call_and_its_generations(model, pb_utils):
    """A stream's tokens the stub could not send: the stream ends there, with the error, and the engine stops."""
    stream = request(pb_utils, [1, 2], **STREAMING)
    model.execute([stream])
    send = stream.sender.send

    def refuse_tokens(response=None, flags: int = 0) -> None:
        if response is not None and not response.has_error():
            raise RuntimeError("the stub failed to send")
        send(response, flags)

    stream.sender.send = refuse_tokens
    model.engine.emit("e0", Emission([5]))
    [(response, flags)] = stream.sender.sent
    assert flags == FINAL and "the stub failed to send" in response.error().message()
    assert model.engine.cancels == ["e0"] and model.engine.running() == 0 and model._live == {}
    assert "generation_failed" in drain(model._finished)


@pytest.mark.parametrize("extra", [{}, {"num_return_sequences": np.array([[2]], np.int32)}], ids=["one", "n=2"])
def test_a_cancel_while_the_engine_takes_a_request_is_not_lost(model, pb_utils, extra):
    """The sender's check may cancel a call after the engine's `submit` took its last generation and before its id
    is kept: that cancel misses the generation, which must not run on for a client that left."""
    call = request(pb_utils, [1, 2], **extra)
    rows = 2 if extra else 1
    submit = model.engine.submit

    def submit_then_cancelled(generation: GenerationRequest, emit: Callable[[Emission], None]) -> str:
        engine_id = submit(generation, emit)
        if model.engine.submitted == rows:
            call.sender.cancelled = True
            model._check_cancelled()
        return engine_id

    model.engine.submit = submit_then_cancelled
    model.execute([call])
    assert set(model.engine.cancels) == {f"e{row}" for row in range(rows)} and model.engine.running() == 0
    assert finals(pb_utils, call.sender) == 1 and model._live == {}


def test_a_sequence_ending_without_new_tokens_does_not_end_the_others(model, pb_utils):
    """Of num_return_sequences streams, one that ends with an empty emission has nothing to send: the request's
    final response is still the last sequence's."""
    call = request(pb_utils, [1, 2], num_return_sequences=np.array([[2]], np.int32), **STREAMING)
    model.execute([call])
    model.engine.emit("e0", Emission([5]))
    model.engine.emit("e0", Emission([], FINISH_EOS))
    assert finals(pb_utils, call.sender) == 0, "a sequence is still running"
    model.engine.emit("e1", Emission([6], FINISH_LENGTH))
    assert [flags for _, flags in call.sender.sent] == [0, FINAL]
    assert [output_ids(pb_utils, r) for r, _ in call.sender.sent] == [[[[5]]], [[[6]]]]


def test_finalize_frees_the_response_senders_of_answered_calls(model, pb_utils):
    """A call and its generations hold each other: left to the interpreter's last collection at the stub's exit, their
    response sender's destructor finds the server's shared memory gone (a segfault, tritonserver exits nonzero)."""
    import gc
    import weakref

    gc.disable()  # as when no automatic collection happens to run before the unload
    try:
        calls = [request(pb_utils, [1, 2]), request(pb_utils, [3, 4], **STREAMING)]
        model.execute(calls)
        model.engine.finish_all()
        assert [finals(pb_utils, call.sender) for call in calls] == [1, 1]
        senders = [weakref.ref(call.sender) for call in calls]
        del calls
        model.finalize()
        assert [sender() for sender in senders] == [None, None]
    finally:
        gc.enable()
