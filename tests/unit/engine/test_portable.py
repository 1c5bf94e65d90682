"""The portable engine in-process: greedy equals `generate`, seeded sampling, stop/bad words, streaming, cancel."""

import os
import queue
import threading
import time

import pytest
import torch

from tests.unit.engine.conftest import chat_ids
from tritonllm.engine.api import EngineConfig, GenerationRequest, SamplingParams
from tritonllm.engine.portable import PortableEngine
from tritonllm.errors import EngineFailure
from tritonllm.protocol import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP


def reference(hf_model, ids, n, end_id):
    out = hf_model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=end_id, pad_token_id=end_id
    )[0, len(ids) :].tolist()
    return out[: out.index(end_id)] if end_id in out else out


@pytest.mark.parametrize("prompt", ["What is the capital of France?", "用一句话介绍北京。"])
def test_greedy_equals_generate(engine, tokenizer, hf_model, prompt):
    ids = chat_ids(tokenizer, prompt)
    tokens, reason = engine.generate(GenerationRequest(ids, 24, end_id=tokenizer.eos_token_id), timeout=120)
    assert tokens == reference(hf_model, ids, 24, tokenizer.eos_token_id)
    assert reason in (FINISH_EOS, FINISH_LENGTH)


def test_concurrent_requests_batch_and_stay_correct(engine, tokenizer):
    prompts = [chat_ids(tokenizer, f"Name a color. Number {i}.") for i in range(8)]
    alone = [engine.generate(GenerationRequest(p, 12, end_id=-1), timeout=120)[0] for p in prompts[:2]]
    results = [None] * len(prompts)

    def run(i):
        results[i] = engine.generate(GenerationRequest(prompts[i], 12, end_id=-1), timeout=300)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None and len(r[0]) == 12 and r[1] == FINISH_LENGTH for r in results)
    assert [r[0] for r in results[:2]] == alone
    assert engine.running() == 0


def test_seeded_sampling_is_repeatable(engine, tokenizer):
    ids = chat_ids(tokenizer, "Write a poem about the sea.")
    sampled = lambda seed: engine.generate(  # noqa: E731
        GenerationRequest(ids, 16, sampling=SamplingParams(True, 1.0, 0, 1.0, seed)), timeout=120
    )[0]
    first = sampled(1)
    assert sampled(1) == first
    assert any(sampled(seed) != first for seed in (2, 3, 4))


def test_top_k_one_is_greedy(engine, tokenizer):
    ids = chat_ids(tokenizer, "Say hello.")
    greedy = engine.generate(GenerationRequest(ids, 10), timeout=120)[0]
    topk1 = engine.generate(GenerationRequest(ids, 10, sampling=SamplingParams(True, 0.7, 1, 1.0, 9)), timeout=120)[0]
    assert topk1 == greedy


def test_stop_words_end_generation(engine, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    stop = tuple(tokenizer.encode(" Paris", add_special_tokens=False))
    tokens, reason = engine.generate(
        GenerationRequest(ids, 30, end_id=tokenizer.eos_token_id, stop_words=(stop,)), timeout=120
    )
    assert reason == FINISH_STOP
    assert tuple(tokens[-len(stop) :]) == stop


def test_bad_words_are_never_generated(engine, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    banned = tuple(tokenizer.encode(" Paris", add_special_tokens=False))
    tokens, _ = engine.generate(
        GenerationRequest(ids, 30, end_id=tokenizer.eos_token_id, bad_words=(banned,)), timeout=120
    )
    assert banned[0] not in tokens


def test_streaming_emits_new_tokens_only(engine, tokenizer):
    ids = chat_ids(tokenizer, "Count from one to ten.")
    whole, _ = engine.generate(GenerationRequest(ids, 20, end_id=-1), timeout=120)
    emissions, done = [], threading.Event()

    def emit(e):
        emissions.append(e)
        if e.final:
            done.set()

    engine.submit(GenerationRequest(ids, 20, end_id=-1, streaming=True), emit)
    assert done.wait(120)
    assert [t for e in emissions for t in e.token_ids] == whole
    assert all(e.token_ids for e in emissions[:-1]) and len(emissions) > 2
    assert emissions[-1].finish_reason == FINISH_LENGTH


def test_cancel_frees_the_slot(engine, tokenizer):
    ids = chat_ids(tokenizer, "Tell me a long story.")
    finals = []
    request_id = engine.submit(GenerationRequest(ids, 900, end_id=-1), lambda e: e.final and finals.append(e))
    time.sleep(0.5)
    engine.cancel(request_id)
    assert finals and finals[0].finish_reason == FINISH_CANCELLED
    assert engine.running() == 0
    tokens, _ = engine.generate(GenerationRequest(ids, 4, end_id=-1), timeout=60)
    assert len(tokens) == 4


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
