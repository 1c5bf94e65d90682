"""The transformers engine's own behaviour: its batching manager's refusals, CPU threads, CUDA-only options."""

import os
import queue
import re
import threading

import pytest
import transformers

from tests.conftest import ROOT
from tests.unit.engine.conftest import chat_ids
from tritonllm.engine.api import EngineConfig, GenerationRequest, SamplingParams
from tritonllm.engine.portable import PortableEngine
from tritonllm.errors import ConfigError, EngineFailure
from tritonllm.versions import TRANSFORMERS_VERSION


@pytest.mark.parametrize(("refusal", "error"), [("raises", queue.Full), ("drops", EngineFailure)])
def test_a_request_the_manager_does_not_take_leaves_no_trace(engine, tokenizer, monkeypatch, refusal, error):
    """transformers' add_request raises (its queue full) or returns None (its loop stopping): no slot stays taken."""

    def add_request(**kwargs):
        if refusal == "raises":
            raise queue.Full
        return None

    monkeypatch.setattr(engine._manager, "add_request", add_request)
    emissions = []
    with pytest.raises(error):
        engine.submit(GenerationRequest(chat_ids(tokenizer, "Hi"), 4, end_id=-1), emissions.append)
    assert engine.running() == 0 and engine._active == {}
    assert emissions == []
    monkeypatch.undo()
    tokens, _ = engine.generate(GenerationRequest(chat_ids(tokenizer, "Hi"), 4, end_id=-1), timeout=60)
    assert len(tokens) == 4


def test_on_cpu_only_the_generation_loop_yields_the_cores(engine):
    """Its OpenMP team inherits its priority; the output router, which feeds the response sender, keeps ours."""
    nice = lambda thread: os.getpriority(os.PRIO_PROCESS, thread.native_id)  # noqa: E731
    assert nice(engine._manager._generation_thread) > nice(engine._router) == os.getpriority(os.PRIO_PROCESS, 0)


def test_cuda_only_options_are_off_on_the_cpu(manifest):
    config = EngineConfig(manifest["model_dir"], device="cpu", async_batching=True, cuda_graphs=True, compile=True)
    resolved = config.resolve()
    assert not (resolved.async_batching or resolved.cuda_graphs or resolved.compile)
    assert (resolved.dtype, resolved.attention, resolved.engine_process) == ("float32", "sdpa", False)


def test_compiled_engine_matches_eager(engine, manifest, tokenizer):
    """torch.compile of the step (EngineConfig.compile): the same tokens for greedy, banned and seeded requests,
    with every decoder layer compiled (dynamo's default recompile limit would leave most of them eager)."""
    import logging

    limit_hits: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: limit_hits.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torch._dynamo").addHandler(handler)
    compiled = PortableEngine(
        EngineConfig(
            manifest["model_dir"],
            dtype=manifest["dtype"],
            max_batch_size=4,
            max_seq_len=512,
            kv_cache_tokens=2048,
            compile=True,
        )
    )
    try:
        ids = chat_ids(tokenizer, "What is the capital of France?")
        banned = (tuple(tokenizer.encode(" Paris", add_special_tokens=False)),)
        requests = [
            GenerationRequest(ids, 12),
            GenerationRequest(ids, 12, bad_words=banned),
            GenerationRequest(ids, 12, sampling=SamplingParams(True, 0.8, 0, 0.9, 5)),
        ]
        for request in requests:
            assert compiled.generate(request, timeout=600) == engine.generate(request, timeout=120)
    finally:
        compiled.shutdown()
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not [m for m in limit_hits if "recompile_limit" in m]


def test_another_transformers_release_is_refused_at_load_naming_the_one_needed(manifest, monkeypatch):
    """An image's own transformers used to drop options silently or fail at the attention, naming neither."""
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(ConfigError, match=rf"needs transformers=={re.escape(TRANSFORMERS_VERSION)}.*has 5\.17\.0"):
        PortableEngine(EngineConfig(manifest["model_dir"], device="cpu"))


def test_the_pinned_transformers_is_the_one_requirements_install():
    pins = (ROOT / "requirements.txt").read_text()
    assert re.search(rf"^transformers=={re.escape(TRANSFORMERS_VERSION)}\s", pins, re.M)
    assert transformers.__version__ == TRANSFORMERS_VERSION


def test_an_output_routed_after_a_cancel_emits_nothing_more(engine, tokenizer):
    """The router takes a request's state, then a cancel from another thread ends it: the output it goes on to
    route must not follow the final emission with tokens (transformers' manager may still report one)."""
    from types import SimpleNamespace

    from transformers.generation.continuous_batching.requests import RequestStatus

    emissions, started = [], threading.Event()

    def emit(emission):
        emissions.append(emission)
        started.set()

    request_id = engine.submit(
        GenerationRequest(chat_ids(tokenizer, "Tell me a long story."), 200, end_id=-1, streaming=True), emit
    )
    assert started.wait(60)
    with engine._lock:
        active = engine._active[request_id]
    engine.cancel(request_id)
    assert emissions[-1].final
    count = len(emissions)
    late = SimpleNamespace(
        status=RequestStatus.DECODING,
        timestamps=[],
        logprobs=None,
        generated_tokens=[*active.tokens, 7, 8],
        is_finished=lambda: False,
    )
    engine._advance(request_id, active, late)
    assert len(emissions) == count, "an emission after the final one"
