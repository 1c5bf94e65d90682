"""The llama.cpp engine against llama.cpp itself and against transformers, and its admission to a full cache."""

import dataclasses
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from tests.conftest import BUILD
from tests.unit.engine.conftest import chat_ids
from tests.unit.engine.test_cpu_engines import make_engine
from tritonllm.engine.api import (
    GGUF_AS_IS,
    LLAMACPP,
    TRANSFORMERS,
    EngineConfig,
    GenerationRequest,
    Guide,
    Penalties,
    SamplingParams,
)
from tritonllm.errors import ConfigError, EngineFailure, InputError
from tritonllm.protocol import FINISH_LENGTH
from tritonllm.repository.model_source import default_model_file, retype_gguf

CACHE_TOKENS = 4096
PROMPTS = ["What is the capital of France?", "Write a haiku about rain."]


def llama_cpp_greedy(gguf: str, ids: list[int], n: int) -> list[int]:
    """llama.cpp's own greedy generation (llama-cpp-python's high-level API, one sequence), with the engine's
    attention (flash attention, which llama.cpp picks on the CPU), cache size and threads: each sums in its own
    order, and a quantized model's near-ties then go either way."""
    from llama_cpp import Llama

    threads = len(os.sched_getaffinity(0))
    llm = Llama(gguf, n_ctx=CACHE_TOKENS, flash_attn=True, n_threads=threads, n_threads_batch=threads, verbose=False)
    out = []
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == n:
            break
    return out


@pytest.fixture(scope="module", params=["float32", GGUF_AS_IS])
def gguf(request) -> str:
    """The float32 GGUF the build writes by default, and the packaged (Q4_1) file as `--dtype gguf` serves it."""
    if request.param == GGUF_AS_IS:
        return str(default_model_file())
    return str(retype_gguf(default_model_file(), request.param, BUILD / "models"))


@pytest.fixture(scope="module")
def engine(manifest, gguf):
    eng = make_engine(
        manifest, LLAMACPP, gguf_file=gguf, max_batch_size=8, max_seq_len=1024, kv_cache_tokens=CACHE_TOKENS
    )
    yield eng
    eng.shutdown()


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(True, 0.9, 0, 0.95, 11), SamplingParams(True, 1.2, 40, 1.0, 5)],
    ids=["greedy", "nucleus", "top-k"],
)
def test_bias_and_sampling_choose_as_the_controls_path(engine, tokenizer, sampling):
    """A bias and sampling, with and without log probabilities: the tokens agree (log probabilities are of the raw
    logits and change no choice), and the banned tokens (the plain answer's first ones, each listed twice so the two
    halves add up) never come; nor does the end id before min_tokens."""
    ids = chat_ids(tokenizer, PROMPTS[0])
    plain, _ = engine.generate(GenerationRequest(ids, 12), timeout=120)
    bias = tuple((token, -60.0) for token in plain[:3]) * 2
    request = GenerationRequest(
        ids,
        12,
        end_id=tokenizer.eos_token_id,
        sampling=sampling,
        embedding_bias=bias,
        penalties=Penalties(min_tokens=4),
    )
    fast, _ = engine.generate(request, timeout=120)
    controlled, _ = engine.generate(dataclasses.replace(request, log_probs=0), timeout=120)
    assert fast == controlled
    assert len(fast) >= 4 and not set(plain[:3]) & set(fast)
    assert fast != plain


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_llama_cpp_itself(engine, gguf, tokenizer, prompt):
    ids = chat_ids(tokenizer, prompt)
    tokens, reason = engine.generate(GenerationRequest(ids, 24), timeout=120)
    assert reason == FINISH_LENGTH
    assert tokens == llama_cpp_greedy(gguf, ids, 24)


def test_float32_log_probs_match_transformers(manifest, tokenizer, hf_model):
    """On the float32 GGUF, each generated token's log probability is transformers' within 0.1 (a float32
    computation in another order), and every greedy choice is transformers' argmax."""
    eng = make_engine(manifest, LLAMACPP, max_batch_size=2, max_seq_len=512, kv_cache_tokens=1024)
    try:
        ids = chat_ids(tokenizer, PROMPTS[0])
        emissions = []
        done = threading.Event()
        eng.submit(GenerationRequest(ids, 16, log_probs=0), lambda e: (emissions.append(e), e.final and done.set()))
        assert done.wait(120)
    finally:
        eng.shutdown()
    tokens = [t for e in emissions for t in e.token_ids]
    ours = torch.tensor([p.log_prob for e in emissions for p in e.log_probs])
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
    theirs = logits.log_softmax(-1)
    assert theirs.argmax(-1).tolist() == tokens
    assert (ours - theirs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)).abs().max() < 0.1


def test_requests_wait_for_cache_room_and_all_finish(manifest, tokenizer):
    """A cache of 256 tokens holds five of these requests at once: the others wait their turn, none fails."""
    eng = make_engine(manifest, LLAMACPP, max_batch_size=8, max_seq_len=256, kv_cache_tokens=256)
    try:
        ids = chat_ids(tokenizer, "Name a color.")
        need = len(ids) + 12
        alone = eng.generate(GenerationRequest(ids, 12), timeout=60)[0]
        results, peak = [], [0]

        def run():
            results.append(eng.generate(GenerationRequest(ids, 12), timeout=120))
            peak[0] = max(peak[0], eng.in_batch())

        threads = [threading.Thread(target=run) for _ in range(8)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak[0] = max(peak[0], eng.in_batch())
            threads[0].join(0.001)
    finally:
        eng.shutdown()
    assert [r for r in results] == [(alone, FINISH_LENGTH)] * 8
    assert 1 <= peak[0] <= 256 // need < 8


def final_emission(engine, request: GenerationRequest):
    done, emissions = threading.Event(), []
    engine.submit(request, lambda e: (emissions.append(e), e.final and done.set()))
    assert done.wait(120)
    return emissions[-1]


def test_prefix_cache_starts_a_prompt_from_an_earlier_ones_cache(manifest, tokenizer):
    """A repeated prompt, a new question after the same system prompt and the next turn of a chat start from the
    kept cache (all of the prompt but its last token, the system prompt, the whole earlier turn) and answer what an
    engine without the cache answers."""
    system = {"role": "system", "content": "You are a terse assistant who answers in one short sentence."}

    def chat(*turns: str) -> list[int]:
        messages = [system] + [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))

    def answers(prefix_cache: bool, prompts: list[list[int]]) -> list:
        eng = make_engine(
            manifest, LLAMACPP, max_batch_size=2, max_seq_len=512, kv_cache_tokens=2048, prefix_cache=prefix_cache
        )
        try:
            return [final_emission(eng, GenerationRequest(ids, 16)) for ids in prompts]
        finally:
            eng.shutdown()

    first = chat(PROMPTS[0])
    (reply,) = answers(False, [first])
    prompts = [first, first, chat(PROMPTS[1]), chat(PROMPTS[0], tokenizer.decode(reply.token_ids), PROMPTS[1])]
    plain, cached = answers(False, prompts), answers(True, prompts)
    assert [e.token_ids for e in cached] == [e.token_ids for e in plain]
    assert all(e.cached_tokens == 0 for e in plain)
    shared = next(i for i, (a, b) in enumerate(zip(first, prompts[2], strict=False)) if a != b)
    assert [e.cached_tokens for e in cached[:3]] == [0, len(first) - 1, shared]
    assert cached[3].cached_tokens > len(first), "the earlier turn's prompt and answer came from the cache"


def test_prefix_cache_gives_its_room_to_new_requests(manifest, tokenizer):
    """Kept cells fill a small cache; requests that need the room get it (oldest kept first) and none waits for ever,
    one at a time and eight at once (four running need 280 cells of the 256: they wait for each other's room too)."""
    eng = make_engine(manifest, LLAMACPP, max_batch_size=4, max_seq_len=128, kv_cache_tokens=256, prefix_cache=True)
    try:
        prompts = [chat_ids(tokenizer, f"Count from {n} to {n + 5}.") for n in range(8)]
        for ids in prompts:
            assert final_emission(eng, GenerationRequest(ids, 32)).finish_reason == FINISH_LENGTH
        results = []
        threads = [
            threading.Thread(target=lambda ids=ids: results.append(eng.generate(GenerationRequest(ids, 32), 120)))
            for ids in prompts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        eng.shutdown()
    assert [reason for _, reason in results] == [FINISH_LENGTH] * 8


def test_prefix_cache_keeps_its_cells_while_a_request_waits_for_room(manifest, tokenizer):
    """A request that waits for a running one's room drops no kept cells for nothing: once the long request is
    cancelled (few cells kept of it) the waiting one runs, and an earlier prompt still finds all its cells."""
    eng = make_engine(manifest, LLAMACPP, max_batch_size=4, max_seq_len=512, kv_cache_tokens=512, prefix_cache=True)
    try:
        first, other = chat_ids(tokenizer, PROMPTS[0]), chat_ids(tokenizer, PROMPTS[1])
        raw = tokenizer(PROMPTS[1])["input_ids"]  # shares no first token with the chat prompts
        assert final_emission(eng, GenerationRequest(first, 8)).cached_tokens == 0
        started, done, waiting = threading.Event(), threading.Event(), []
        long = eng.submit(GenerationRequest(other, 440 - len(other), streaming=True), lambda e: started.set())
        assert started.wait(60)
        eng.submit(GenerationRequest(raw, 100), lambda e: (waiting.append(e), e.final and done.set()))
        time.sleep(0.5)  # 440 cells held and ~110 asked of 512: it waits
        assert not waiting
        eng.cancel(long)
        assert done.wait(60) and waiting[-1].finish_reason == FINISH_LENGTH
        again = final_emission(eng, GenerationRequest(first, 8))
    finally:
        eng.shutdown()
    assert again.cached_tokens == len(first) - 1


def test_a_request_longer_than_the_sequence_limit_is_refused(engine):
    """The admission reserves a request's prompt and new tokens: more than --max-seq-len is refused, not cut."""
    with pytest.raises(InputError, match="request_output_len: 10 input tokens and 1015 new ones"):
        engine.submit(GenerationRequest([1] * 10, 1015), lambda e: None)


@pytest.mark.parametrize(
    "prompt", [{"input_ids": [1, 2], "attention_mask": [1, 1]}, "hello", [], [[1, 2]], [1.5], (1, 2)]
)
def test_a_prompt_that_is_not_a_list_of_token_ids_is_refused_and_the_loop_goes_on(engine, prompt):
    """A tokenizer's whole output passed in-process used to reach the step loop and stop it for every request."""
    with pytest.raises(InputError, match="input_ids"):
        engine.submit(GenerationRequest(prompt, 2), lambda e: None)
    assert final_emission(engine, GenerationRequest([1, 2, 3], 2)).finish_reason == FINISH_LENGTH


def test_dtype_gguf_is_for_the_llama_cpp_engine_only(manifest):
    config = EngineConfig(manifest["model_dir"], impl=TRANSFORMERS, dtype=GGUF_AS_IS, device="cpu")
    with pytest.raises(ConfigError, match=r"--dtype gguf is for the llama\.cpp engine"):
        config.resolve()


@pytest.mark.parametrize(
    ("impl", "option", "flag"),
    [(LLAMACPP, {"attention": "sdpa"}, "--attention"), (LLAMACPP, {"fused_norms": False}, "--fused-norms"),
     (LLAMACPP, {"fused_projections": False}, "--fused-projections"),
     (TRANSFORMERS, {"prefix_cache": True}, "--prefix-cache")],
)  # fmt: skip
def test_another_engines_options_are_refused_not_ignored(manifest, impl, option, flag):
    gguf = str(default_model_file())
    other = TRANSFORMERS if impl == LLAMACPP else LLAMACPP
    with pytest.raises(ConfigError, match=f"{flag}: an option of --engine-impl {other}; this build runs {impl}"):
        EngineConfig(manifest["model_dir"], impl=impl, gguf_file=gguf, device="cpu", **option).resolve()
    resolved = EngineConfig(manifest["model_dir"], impl=impl, gguf_file=gguf, device="cpu").resolve()
    assert resolved == resolved.resolve(), "a written configuration resolves to itself"


def test_llamacpp_needs_a_gguf_model(manifest):
    with pytest.raises(ConfigError, match="needs a GGUF model"):
        EngineConfig(manifest["model_dir"], impl=LLAMACPP, device="cpu").resolve()


def test_the_greedy_path_keeps_the_end_id_out_before_min_tokens():
    """TensorRT-LLM's default minimum length of 1 on NVIDIA's interface: the greedy path, which runs no
    logits processor, takes the next best token instead of the end id, only while fewer than min_tokens."""
    from tritonllm.engine.llamacpp import greedy_token

    scores = np.array([0.1, 3.0, 2.0, 0.5], np.float32)  # the end id, 1, is the argmax
    request = GenerationRequest([7], 4, end_id=1, penalties=Penalties(min_tokens=1))
    assert greedy_token(scores, 1, request, []) == 2
    assert greedy_token(scores, 1, request, [2]) == 1, "min_tokens reached: the end id may come"
    assert greedy_token(scores, 1, GenerationRequest([7], 4, end_id=1), []) == 1, "min_tokens 0"
    assert scores[1] == 3.0, "the logits row is left as it was"


def test_a_submit_after_the_engine_failed_is_refused_not_lost(manifest):
    """_fail_all ends every request; one submitted just after, while the loop thread still runs, used to register
    and wait forever. Under the same lock it is refused, or finished with the others."""
    eng = make_engine(manifest, LLAMACPP, max_batch_size=2, max_seq_len=256, kv_cache_tokens=512)
    try:
        eng._fail_all("the engine's step loop failed: a test")
        with pytest.raises(EngineFailure, match="a test"):
            eng.submit(GenerationRequest([1, 2, 3], 2), lambda e: None)
    finally:
        eng.shutdown()


def test_the_first_guided_requests_at_once_share_one_guides(manifest, tokenizer, monkeypatch):
    """Four submitter threads met no Guides and each made one (a tokenizer and a compiler each), and the matchers of
    all but the last were never released."""
    from tritonllm.engine.guided import Guides

    made, init = [], Guides.__init__

    def slow_init(self, *args) -> None:
        made.append(self)
        time.sleep(0.2)  # as a first import and a tokenizer take their time
        init(self, *args)

    monkeypatch.setattr(Guides, "__init__", slow_init)
    eng = make_engine(manifest, LLAMACPP, max_batch_size=4, max_seq_len=256, kv_cache_tokens=1024)
    try:
        ids, guide = chat_ids(tokenizer, "Is Paris in France?"), Guide("regex", "(yes|no)")
        request = GenerationRequest(ids, 4, end_id=tokenizer.eos_token_id, guide=guide)
        results: list = []
        run = lambda: results.append(eng.generate(request, timeout=120))  # noqa: E731
        threads = [threading.Thread(target=run) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert len(results) == 4 and len(made) == 1
        assert made[0] is eng._guides and len(eng._guides) == 0  # every matcher released
    finally:
        eng.shutdown()


def test_a_guided_submit_refused_after_the_engine_failed_releases_its_matcher(manifest):
    eng = make_engine(manifest, LLAMACPP, max_batch_size=2, max_seq_len=256, kv_cache_tokens=512)
    try:
        eng._fail_all("the engine's step loop failed: a test")
        with pytest.raises(EngineFailure, match="a test"):
            eng.submit(GenerationRequest([1, 2, 3], 2, guide=Guide("regex", "(yes|no)")), lambda e: None)
        assert len(eng._guides) == 0
    finally:
        eng.shutdown()


def test_no_control_but_a_grammar_loads_torch_in_the_engines_process(manifest):
    """torch costs the engine's process ~300 MiB and ~3 s to load: a request with every other control (a bias,
    penalties, bad words, min_tokens, sampling, log probabilities) is served in numpy without it. A fresh
    interpreter: this one has torch already."""
    gguf = str(retype_gguf(default_model_file(), "float32", BUILD / "models"))
    config = EngineConfig(
        manifest["model_dir"], impl=LLAMACPP, gguf_file=gguf, max_batch_size=2, max_seq_len=256, kv_cache_tokens=512
    ).resolve()
    script = f"""
import sys
from tritonllm.engine.api import EngineConfig, GenerationRequest, Penalties, SamplingParams
from tritonllm.engine.llamacpp import LlamaCppEngine
engine = LlamaCppEngine(EngineConfig(**{dataclasses.asdict(config)!r}))  # as the engine model loads it
penalties = Penalties(repetition=1.3, presence=0.5, frequency=0.2, min_tokens=6)
request = GenerationRequest(
    [1, 2, 3, 2], 6, end_id=2, penalties=penalties, sampling=SamplingParams(True, 0.8, 20, 0.9, 7),
    embedding_bias=((5, -3.0),), bad_words=((4, 6),), log_probs=3,
)
tokens, reason = engine.generate(request, timeout=120)
print(len(tokens), "torch" in sys.modules)
engine.shutdown()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["6", "False"], done.stdout


def test_prefix_cache_publishes_its_kept_blocks_and_their_removal(manifest, tokenizer, tmp_path):
    """With a KV-events endpoint, what the cache keeps is announced as stored blocks (the kept cells' full blocks) and
    what gives way as removed ones, so that a router (Dynamo's) knows what this engine holds."""
    import zmq

    from tritonllm.engine.kv_events import block_hashes
    from tritonllm.protocol import KV_EVENT_BLOCK_TOKENS

    endpoint = f"ipc://{tmp_path}/events"
    eng = make_engine(
        manifest,
        LLAMACPP,
        max_batch_size=4,
        max_seq_len=128,
        kv_cache_tokens=256,
        prefix_cache=True,
        kv_events=endpoint,
    )
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(endpoint)
    time.sleep(0.3)  # the subscription reaches the publisher (ZeroMQ drops what a PUB sends before)

    def events() -> list[dict]:
        got = []
        while subscriber.poll(300):
            got.append(subscriber.recv_json())
        return got

    try:
        prompt = chat_ids(tokenizer, "Tell me about the rivers of France. " * 4)
        final = final_emission(eng, GenerationRequest(prompt, 8))
        (stored,) = events()
        kept = np.array((prompt + final.token_ids)[: len(prompt) + len(final.token_ids) - 1], np.int32)
        assert stored["type"] == "stored" and stored["parent_hash"] is None
        assert stored["block_hashes"] == block_hashes(kept, KV_EVENT_BLOCK_TOKENS)
        assert stored["token_ids"] == kept[: len(stored["block_hashes"]) * KV_EVENT_BLOCK_TOKENS].tolist()
        # Other prompts fill the ids and the room, and kept cells give way: replayed, the events hold what the cache
        # holds, block for block.
        announced = set(stored["block_hashes"])
        for n in range(10):
            final_emission(eng, GenerationRequest(chat_ids(tokenizer, f"Count from {n} to {n + 5}, slowly."), 32))
            time.sleep(0.05)
        later = events()
        assert {e["type"] for e in later} == {"stored", "removed"}
        for event in later:
            if event["type"] == "stored":
                assert not announced & set(event["block_hashes"]), "a block was stored twice"
                announced |= set(event["block_hashes"])
            else:
                assert set(event["block_hashes"]) <= announced, "a block was removed that was never stored"
                announced -= set(event["block_hashes"])
        held = {
            h
            for seq_id, cells in eng._kept.items()
            for h in block_hashes(cells, KV_EVENT_BLOCK_TOKENS, eng._kept_adapter[seq_id])
        }
        assert announced == held
    finally:
        subscriber.close()
        eng.shutdown()
