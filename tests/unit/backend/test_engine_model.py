"""Unit: the portable engine's Triton adapter (backend.engine_model) answers every request once, on a fake pb_utils."""

from __future__ import annotations

import queue
from collections.abc import Callable

import numpy as np
import pytest

from tests.unit.backend import fake_pb_utils
from tritonllm.engine.api import FINISH_CANCELLED, FINISH_LENGTH, Emission, GenerationRequest
from tritonllm.text.tokenization import Limits


class FakeEngine:
    """Takes requests and answers them when the test says; `submit` raises for a prompt starting with `refuse`."""

    def __init__(self, refuse: int) -> None:
        self.refuse = refuse
        self.taken: dict[str, tuple[GenerationRequest, Callable[[Emission], None]]] = {}

    def submit(self, request: GenerationRequest, emit: Callable[[Emission], None]) -> str:
        if request.input_ids[0] == self.refuse:
            raise RuntimeError("the engine refused this one")
        engine_id = f"e{len(self.taken)}"
        self.taken[engine_id] = (request, emit)
        return engine_id

    def finish_all(self) -> None:
        while self.taken:
            request, emit = self.taken.pop(next(iter(self.taken)))  # finished: a later cancel is a no-op
            emit(Emission(list(range(request.max_new_tokens)), FINISH_LENGTH))

    def cancel(self, engine_id: str) -> None:
        taken = self.taken.pop(engine_id, None)
        if taken is not None:
            taken[1](Emission([], FINISH_CANCELLED))

    def running(self) -> int:
        return len(self.taken)


class InlineOutbox:
    """Sends at once, on the caller's thread: the order of events is the test's."""

    def __init__(self, send: Callable) -> None:
        self.send = send

    def put(self, call, emission: Emission) -> None:
        self.send(call, emission)


@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


@pytest.fixture
def model(pb_utils):
    from tritonllm.backend import engine_model

    model = engine_model.EngineModel.__new__(engine_model.EngineModel)  # no engine to load: a fake one
    model.limits = Limits(max_input_len=8, max_seq_len=16, vocab_size=100)
    model.exclude_input = True
    model.capacity = 16
    model.engine = FakeEngine(refuse=7)
    model._live = {}
    model._finished = queue.SimpleQueue()
    model._outbox = InlineOutbox(model._send)
    return model


def request(pb_utils, *prompts: list[int]):
    ids = np.asarray(prompts, dtype=np.int32)
    inputs = {
        "input_ids": ids,
        "input_lengths": np.full((len(prompts),), ids.shape[1], dtype=np.int32),
        "request_output_len": np.full((len(prompts),), 3, dtype=np.int32),
    }
    return pb_utils.Request(inputs)


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
