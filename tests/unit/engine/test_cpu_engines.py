"""Both CPU engines, in-process, through the interface the engine model uses: greedy equals transformers'
`generate` (the llama.cpp engine on the float32 GGUF the build writes), batching, seeded sampling, stop and bad
words, streaming, cancellation."""

import threading
import time

import pytest
import torch

from tests.conftest import BUILD
from tests.unit.engine.conftest import chat_ids
from tritonllm.engine.api import LLAMACPP, TRANSFORMERS, EngineConfig, GenerationRequest, SamplingParams
from tritonllm.protocol import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from tritonllm.repository.model_source import default_model_file, retype_gguf


def make_engine(manifest, impl: str, **options):
    """A CPU engine on the built model: transformers on its folder, llama.cpp on its float32 GGUF."""
    if impl == LLAMACPP:
        from tritonllm.engine.llamacpp import LlamaCppEngine

        gguf = options.pop("gguf_file", None) or str(retype_gguf(default_model_file(), "float32", BUILD / "models"))
        config = EngineConfig(manifest["model_dir"], impl=LLAMACPP, gguf_file=gguf, **options).resolve()
        return LlamaCppEngine(config)
    from tritonllm.engine.portable import PortableEngine

    return PortableEngine(EngineConfig(manifest["model_dir"], impl=TRANSFORMERS, dtype=manifest["dtype"], **options))


@pytest.fixture(scope="module", params=[TRANSFORMERS, LLAMACPP])
def engine(request, manifest):
    eng = make_engine(manifest, request.param, max_batch_size=8, max_seq_len=1024, kv_cache_tokens=8192)
    eng.generate(GenerationRequest([0] * 8, 2), timeout=300)
    yield eng
    eng.shutdown()


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
    """Batched, a request's greedy tokens are those it gets alone. Eight of them: llama.cpp's sums run in another
    order in a batch, and the second prompt's twelfth token is a near-tie that flips on some CPUs."""
    prompts = [chat_ids(tokenizer, f"Name a color. Number {i}.") for i in range(8)]
    alone = [engine.generate(GenerationRequest(p, 8, end_id=-1), timeout=120)[0] for p in prompts[:2]]
    results = [None] * len(prompts)

    def run(i):
        results[i] = engine.generate(GenerationRequest(prompts[i], 8, end_id=-1), timeout=300)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None and len(r[0]) == 8 and r[1] == FINISH_LENGTH for r in results)
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
