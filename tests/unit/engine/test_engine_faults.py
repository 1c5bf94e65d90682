"""Unit: a fault in an engine's step while streamed and whole requests are in flight ends every one of them with an
error within FAULT_SECONDS, never a hang or an empty success; the engine then says it is not alive (the health
probe fails and the watchdog restarts the server: tests/integration/test_faults.py) and refuses new requests, naming
why. A fault in one request's own controls fails that request alone (grammar matchers: test_guided.py)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.unit.engine.conftest import chat_ids, submitted
from tests.unit.engine.test_cpu_engines import make_engine
from tritonllm.engine.api import LLAMACPP, TRANSFORMERS, GenerationRequest, SamplingParams
from tritonllm.engine.health import EngineHealth
from tritonllm.errors import EngineFailure
from tritonllm.protocol import FINISH_EOS, FINISH_ERROR, FINISH_LENGTH

FAULT_SECONDS = 30  # from the fault to the last request's final error
IN_FLIGHT = 6  # half streamed, half whole


class InjectedFault(RuntimeError):
    pass


def failing_after(step, steps: int, started: threading.Event):
    """`step`, which raises InjectedFault from its call number `steps` + 1 on (`started` set at the first)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        started.set()
        if calls[0] > steps:
            raise InjectedFault("injected step fault")
        return step(*args, **kwargs)

    return wrapped


def synthetic_engine():
    from tritonllm.engine.synthetic import SyntheticConfig, SyntheticEngine

    return SyntheticEngine(SyntheticConfig(text_ids=tuple(range(10, 60)), max_batch_size=4, step_ms=2))


def inject(engine, impl: str, steps: int) -> threading.Event:
    """Makes the engine's step fail after `steps` more steps; the event is set once a step has run."""
    started = threading.Event()
    if impl == LLAMACPP:
        engine._step = failing_after(engine._step, steps, started)
    elif impl == TRANSFORMERS:  # the batching manager's step, in its own thread
        engine._manager._generation_step = failing_after(engine._manager._generation_step, steps, started)
    else:
        engine._advance = failing_after(engine._advance, steps, started)  # per sequence and step
    return started


@pytest.fixture(params=[LLAMACPP, TRANSFORMERS, "synthetic"])
def fresh(request, manifest):
    """An engine of its own (the fault ends it), with its impl's name."""
    if request.param == "synthetic":
        engine = synthetic_engine()
    else:
        engine = make_engine(manifest, request.param, max_batch_size=4, max_seq_len=512, kv_cache_tokens=4096)
        engine.generate(GenerationRequest([0] * 8, 2), timeout=300)
    yield engine, request.param
    engine.shutdown()


def test_a_step_fault_under_load_fails_every_request_in_flight_and_the_engine_says_so(fresh, tokenizer):
    engine, impl = fresh
    started = inject(engine, impl, steps=8)
    ids = chat_ids(tokenizer, "Tell me a long story about a river.")
    # More than the batch holds: some wait in the engine's queue when the fault comes.
    requests = [GenerationRequest(ids, 200, end_id=-1, streaming=bool(i % 2)) for i in range(IN_FLIGHT)]
    flights = [submitted(engine, request) for request in requests]
    assert started.wait(60)
    faulted = time.monotonic()
    for done, _ in flights:
        assert done.wait(FAULT_SECONDS), "a request in flight hung after the engine's step failed"
    assert time.monotonic() - faulted < FAULT_SECONDS
    for _, emissions in flights:
        final = emissions[-1]
        assert final.finish_reason == FINISH_ERROR and final.error, final
        assert sum(len(e.token_ids) for e in emissions) < 200, "a request in flight ended as if it had finished"
    assert engine.running() == 0, "a failed request still holds its place"
    assert not engine.alive()
    with pytest.raises(EngineFailure):
        engine.submit(GenerationRequest(ids, 4), lambda emission: None)


@pytest.fixture(scope="module")
def llama(manifest):
    engine = make_engine(manifest, LLAMACPP, max_batch_size=4, max_seq_len=512, kv_cache_tokens=2048)
    yield engine
    engine.shutdown()


def test_a_fault_in_one_requests_controls_fails_it_alone(llama, tokenizer):
    """The llama.cpp engine chooses each request's token with its own controls (penalties, sampling, bias): a fault
    there is that request's, and the step goes on for the others."""
    ids = chat_ids(tokenizer, "What is the capital of France?")
    sampled = GenerationRequest(ids, 48, end_id=-1, sampling=SamplingParams(sample=True, temperature=0.7, seed=1))
    plain = GenerationRequest(ids, 24, end_id=tokenizer.eos_token_id)
    engine_id = llama.submit(sampled, (sampled_emissions := []).append)
    controls = llama._sequences[engine_id].controls
    controls.choose = failing_after(controls.choose, 2, threading.Event())
    done, plain_emissions = submitted(llama, plain)
    assert done.wait(60)
    assert plain_emissions[-1].finish_reason in (FINISH_EOS, FINISH_LENGTH)
    deadline = time.monotonic() + 60
    while not (sampled_emissions and sampled_emissions[-1].final) and time.monotonic() < deadline:
        time.sleep(0.05)
    final = sampled_emissions[-1]
    assert final.finish_reason == FINISH_ERROR and "injected step fault" in final.error, final
    assert llama.alive() and llama.running() == 0
    again, emissions = submitted(llama, plain)
    assert again.wait(60) and emissions[-1].finish_reason in (FINISH_EOS, FINISH_LENGTH)


def stuck_after(step, steps: int, started: threading.Event, release: threading.Event):
    """`step`, which from its call number `steps` + 1 on waits for `release` first: a wedged decode."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] > steps:
            started.set()
            release.wait(FAULT_SECONDS)
        return step(*args, **kwargs)

    return wrapped


def test_a_stuck_step_fails_the_health_probe_and_an_idle_engine_proves_it_generates(fresh, tokenizer):
    """The engine's threads all live while its step is stuck: only its step count says so (engine/health.py)."""
    engine, impl = fresh
    health = EngineHealth(engine, stalled_after=0.5)
    before = engine.steps()
    assert health.problem() is None and engine.steps() > before, "the idle engine's probe generated nothing"
    generated = engine.steps()
    assert health.problem() is None and engine.steps() == generated, "no step since: no second generation"
    stuck, release = threading.Event(), threading.Event()
    if impl == LLAMACPP:
        engine._step = stuck_after(engine._step, 2, stuck, release)
    elif impl == TRANSFORMERS:
        engine._manager._generation_step = stuck_after(engine._manager._generation_step, 2, stuck, release)
    else:
        engine._advance = stuck_after(engine._advance, 2, stuck, release)
    done, emissions = submitted(engine, GenerationRequest(chat_ids(tokenizer, "Hi"), 16, end_id=-1))
    assert stuck.wait(60)
    assert health.problem() is None  # the clock starts at the first probe that sees the count
    time.sleep(0.8)
    problem = health.problem()
    assert problem is not None and "finished no step" in problem, problem
    release.set()
    assert done.wait(60) and emissions[-1].finish_reason == FINISH_LENGTH
    assert health.problem() is None
