"""A Dynamo fleet on loopback: Dynamo's frontend and KV router in front of `tritonllm dynamo-worker`s, each with its
own tritonserver on the prefix-cache build `make test` renders (build/fleet), driven with the official openai client.

Dynamo's own processes (frontend, router) are real; discovery is its file store in the test's folder.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import time

import openai
import pytest

from tests.conftest import BUILD
from tritonllm.dynamo.fleet import Fleet
from tritonllm.launch.tritonserver import metric_value

FLEET_BUILD = BUILD / "fleet"
ENGINE = "tensorrt_llm_decoupled"
PROMPTS = ["The capital of France is", "Water boils at", "The largest planet in the solar system is"]
# Long enough for many 16-token blocks, and unlike anything else the fleet serves.
SHARED_PREFIX = "You are a careful assistant for a library. Answer in one short sentence. " * 12


def served(worker) -> float:
    return metric_value(worker.metrics("nv_inference_request_success"), "nv_inference_request_success", model=ENGINE)


def cached(worker) -> float:
    return metric_value(worker.metrics(), "tritonllm_prefix_cache_tokens_total")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if importlib.util.find_spec("dynamo") is None:
        pytest.fail("needs NVIDIA Dynamo: run `make dynamo` (make test installs it)")
    if not (FLEET_BUILD / "manifest.json").is_file():
        pytest.fail(f"needs the fleet build: {FLEET_BUILD}/manifest.json is missing (make test renders it)")
    fleet = Fleet(FLEET_BUILD, tmp_path_factory.mktemp("fleet"), router_mode="kv", migration_limit=3)
    try:
        fleet.start(workers=1)
    except Exception:
        fleet.stop()
        for log in sorted(fleet.logs.glob("*.log")):
            print(f"== {log.name}\n{log.read_text()[-4000:]}")
        raise
    yield fleet
    fleet.stop()
    for worker in fleet.workers:
        assert "Traceback" not in worker.log.read_text(), worker.log.read_text()[-4000:]


@pytest.fixture(scope="module")
def fleet_api(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_answers_equal_a_single_servers(fleet, fleet_api, openai_frontend):
    single = openai.OpenAI(base_url=openai_frontend(), api_key="unused", max_retries=0, timeout=120)
    model = single.models.list().data[0].id
    assert [m.id for m in fleet_api.models.list().data] == [fleet.model] == [model]
    for prompt in PROMPTS:
        want = single.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        got = fleet_api.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        assert got.usage.completion_tokens == want.usage.completion_tokens
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = single.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    got = fleet_api.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    streamed = fleet_api.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.choices[0].message.content


def test_a_control_the_server_cannot_honour_is_refused_by_name(fleet, fleet_api):
    with pytest.raises(openai.BadRequestError, match=r"sampling_options\.min_p"):
        fleet_api.completions.create(model=fleet.model, prompt="Hi", max_tokens=4, extra_body={"min_p": 0.5})
    with pytest.raises(openai.BadRequestError, match=r"guided_decoding\.choice"):
        fleet_api.completions.create(
            model=fleet.model, prompt="Hi", max_tokens=4, extra_body={"guided_choice": ["yes", "no"]}
        )


def test_a_stream_the_client_drops_is_cancelled_in_the_engine(fleet, fleet_api):
    """The frontend drops the request; the worker's stream to its server closes, and the engine ends the request."""
    (worker,) = fleet.workers
    cancelled = metric_value(worker.metrics(), "tritonllm_requests_finished_total", finish_reason="cancelled")
    chunks = fleet_api.completions.create(
        model=fleet.model, prompt="Tell a long story.", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _ in zip(range(3), chunks, strict=False):
        pass
    chunks.close()
    deadline = time.monotonic() + 20
    while metric_value(worker.metrics(), "tritonllm_requests_finished_total", finish_reason="cancelled") == cancelled:
        assert time.monotonic() < deadline, "the engine still generates for a stream its client dropped"
        time.sleep(0.2)
    assert not metric_value(worker.metrics(), "tritonllm_engine_requests_in_flight")


def test_a_worker_that_joins_later_receives_traffic(fleet, fleet_api):
    first = fleet.workers[0]
    late = fleet.add_worker()
    before = [served(first), served(late)]

    def ask(i: int):
        return fleet_api.completions.create(model=fleet.model, prompt=f"Count to {i}:", max_tokens=24, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    after = [served(first), served(late)]
    assert after[1] > before[1], f"the late worker served nothing: {before} -> {after}"
    assert sum(after) - sum(before) == 8


def test_a_repeated_prefix_lands_on_the_worker_that_cached_it(fleet, fleet_api):
    def ask(question: str):
        messages = [{"role": "system", "content": SHARED_PREFIX}, {"role": "user", "content": question}]
        return fleet_api.chat.completions.create(model=fleet.model, messages=messages, max_tokens=4, temperature=0)

    ask("Where are the atlases?")
    time.sleep(0.5)  # the kept blocks' events reach the router
    before = [(served(w), cached(w)) for w in fleet.workers]
    answers = [ask(q) for q in ("Where are the novels?", "When do you open?", "Can I print here?")]
    shared = min(a.usage.prompt_tokens for a in answers) - 16  # the prefix's tokens, less the questions'
    assert all(a.usage.prompt_tokens_details.cached_tokens >= shared for a in answers)
    deadline = time.monotonic() + 10  # the servers' metrics count a request a little after its answer
    while True:
        after = [(served(w), cached(w)) for w in fleet.workers]
        gained = [(a[0] - b[0], a[1] - b[1]) for b, a in zip(before, after, strict=True)]
        if sorted(gained)[-1][1] >= 3 * shared or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # Every repeat on one worker, whose prefix cache served the shared prefix to each; none on the other.
    assert sorted(gained)[0] == (0, 0), f"the repeats went to several workers: {before} -> {after}"
    assert sorted(gained)[-1][0] == 3 and sorted(gained)[-1][1] >= 3 * shared, f"{before} -> {after}"


def test_killing_a_worker_mid_load_loses_no_request(fleet, fleet_api):
    """Dynamo migrates a stream whose worker died to another (the frontend's --migration-limit); none is lost."""

    def stream(i: int) -> str | None:
        chunks = fleet_api.completions.create(
            model=fleet.model, prompt=f"Write a long story about ship {i}:", max_tokens=32, stream=True, temperature=0
        )
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return reasons[-1] if reasons else None

    victim = fleet.workers[0]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream, i) for i in range(6)]
        deadline = time.monotonic() + 60  # until the victim generates for some of them
        while not metric_value(victim.metrics(), "tritonllm_engine_requests_in_flight"):
            assert time.monotonic() < deadline, "the victim never had a request in flight"
            time.sleep(0.1)
        victim.kill()
        reasons = [s.result(timeout=300) for s in streams]
    assert reasons == ["length"] * 6
    survivor = fleet.workers[1]
    answer = fleet_api.completions.create(model=fleet.model, prompt="After the fault,", max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert survivor.process.poll() is None
