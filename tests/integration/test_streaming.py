"""Integration: streaming through tensorrt_llm_bls (gRPC and HTTP SSE) on a real tritonserver.

For any greedy request, the streamed deltas joined must equal the request/response `ensemble`'s
text_output byte for byte, no delta may carry U+FFFD for a character still being completed,
deltas are never empty except the final one, and the final response says why and how long.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client import generate, infer_inputs, request_tensors, stream
from tests.conftest import ROOT
from tritonllm.launch.tritonserver import metric_samples, metric_value
from tritonllm.text.detokenization import REPLACEMENT

pytestmark = pytest.mark.integration

PROMPTS = {
    "english": "Explain what a rainbow is in two sentences.",
    "chinese": "写一首关于秋天的短诗",
    "japanese": "日本の首都について一文で説明してください。",
    "emoji": "Reply with three emoji that describe a party, then the word done.",
    "code": "Write a Python function that returns the factorial of n.",
}


@pytest.fixture(scope="module")
def urls(server) -> tuple[str, str]:
    return server.http_url, f"{server.host}:{server.grpc_port}"


def collect(grpc_url: str, prompt: str, max_tokens: int, **options) -> tuple[list[str], object]:
    chunks = list(stream(prompt, max_tokens, url=grpc_url, **options))
    return [c.text for c in chunks], chunks[-1]


def check_deltas(deltas: list[str]) -> None:
    assert all(deltas[:-1]), f"empty non-final delta in {deltas!r}"
    assert not any(REPLACEMENT in d for d in deltas), deltas


@pytest.mark.parametrize("name", list(PROMPTS))
def test_stream_equals_ensemble_text(urls, name):
    http_url, grpc_url = urls
    deltas, final = collect(grpc_url, PROMPTS[name], 40)
    check_deltas(deltas)
    assert "".join(deltas) == generate(PROMPTS[name], 40, url=http_url)
    assert final.finish_reason in {"length", "eos"}
    assert 0 < final.num_output_tokens <= 40 and final.num_input_tokens > 0
    assert len(deltas) > 3, "text must arrive in pieces, not at the end"


@pytest.mark.parametrize("max_tokens", range(1, 7))
def test_multibyte_characters_split_across_tokens(urls, max_tokens):
    http_url, grpc_url = urls
    deltas, final = collect(grpc_url, "请用中文说一句关于月亮的话。", max_tokens)
    check_deltas(deltas)
    assert "".join(deltas) == generate("请用中文说一句关于月亮的话。", max_tokens, url=http_url)
    assert final.num_output_tokens == max_tokens or final.finish_reason == "eos"


@pytest.mark.parametrize("stops", [["Paris"], ["is Par"], ["aris"], ["capital of"]])
def test_stop_words_across_token_boundaries(urls, stops):
    http_url, grpc_url = urls
    prompt = "What is the capital of France?"
    deltas, final = collect(grpc_url, prompt, 24, stop=stops)
    joined = "".join(deltas)
    check_deltas(deltas)
    assert final.finish_reason == "stop"
    assert not any(s in joined for s in stops)
    assert joined == generate(prompt, 24, url=http_url, stop=stops)
    assert generate(prompt, 24, url=http_url).startswith(joined)


def test_sixteen_concurrent_streams_with_request_ids_on_one_connection(urls):
    http_url, grpc_url = urls
    prompts = {f"req-{i}": f"Name a fruit that starts with the letter {chr(65 + i)}." for i in range(16)}
    expected = {rid: generate(p, 16, url=http_url) for rid, p in prompts.items()}
    results: dict[str, list[str]] = {rid: [] for rid in prompts}
    done: queue.Queue = queue.Queue()

    def callback(result, error):
        if error is not None:
            done.put(("error", error))
            return
        response = result.get_response()
        text = result.as_numpy("text_output")
        results[response.id].append(text.reshape(-1)[0].decode() if text is not None else "")
        if result.as_numpy("finish_reason") is not None:
            done.put(("done", response.id))

    triton = grpcclient.InferenceServerClient(grpc_url)
    triton.start_stream(callback=callback)
    try:
        for rid, prompt in prompts.items():
            tensors = [*request_tensors(prompt, 16), ("stream", np.array([[True]]), "BOOL")]
            triton.async_stream_infer("tensorrt_llm_bls", infer_inputs(grpcclient, tensors), request_id=rid)
        finished = set()
        while len(finished) < len(prompts):
            kind, value = done.get(timeout=300)
            assert kind == "done", value
            finished.add(value)
    finally:
        triton.stop_stream()
        triton.close()
    for rid in prompts:
        check_deltas(results[rid])
        assert "".join(results[rid]) == expected[rid], rid


def test_sixteen_concurrent_streams_without_request_ids(urls):
    http_url, grpc_url = urls
    prompts = [f"Say a word that rhymes with number {i}." for i in range(16)]
    expected = [generate(p, 16, url=http_url) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outcomes = list(pool.map(lambda p: collect(grpc_url, p, 16), prompts))
    for (deltas, _), want in zip(outcomes, expected, strict=True):
        check_deltas(deltas)
        assert "".join(deltas) == want


def sse_events(url: str, body: dict) -> list[dict]:
    request = urllib.request.Request(
        f"http://{url}/v2/models/tensorrt_llm_bls/generate_stream", method="POST", data=json.dumps(body).encode()
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        payload = response.read().decode()
    return [json.loads(line[len("data: ") :]) for line in payload.splitlines() if line.startswith("data: ")]


def test_http_generate_stream(urls):
    http_url, _ = urls
    prompt = PROMPTS["chinese"]
    events = sse_events(
        http_url,
        {
            "text_input": prompt,
            "max_tokens": 32,
            "apply_chat_template": True,
            "stream": True,
            "return_num_output_tokens": True,
        },
    )
    assert all("error" not in e for e in events)
    deltas = [e["text_output"] for e in events]
    check_deltas(deltas)
    assert "".join(deltas) == generate(prompt, 32, url=http_url)
    assert events[-1]["finish_reason"] in {"length", "eos"} and events[-1]["num_output_tokens"] > 0
    assert len(events) > 3


def test_stream_false_answers_once(urls):
    http_url, _ = urls
    prompt = PROMPTS["english"]
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/tensorrt_llm_bls/generate",
        method="POST",
        data=json.dumps(
            {"text_input": prompt, "max_tokens": 24, "apply_chat_template": True, "return_num_output_tokens": True}
        ).encode(),
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    assert answer["text_output"] == generate(prompt, 24, url=http_url)
    assert answer["num_output_tokens"] > 0


def test_bad_input_on_the_stream_is_an_error_not_a_hang(urls):
    _, grpc_url = urls
    from client import GenerationError

    with pytest.raises(GenerationError, match="max_tokens"):
        list(stream("hi", 0, url=grpc_url))


def in_flight(server) -> float:
    samples = metric_samples(server.metrics())
    name = "tritonllm_engine_requests_in_flight"
    assert any(key.startswith(name + "{") for key in samples), "the engine's in-flight gauge is missing from /metrics"
    return metric_value(samples, name)


def wait_for_in_flight(server, value: float, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    seen = in_flight(server)
    while seen != value and time.monotonic() < deadline:
        time.sleep(0.25)
        seen = in_flight(server)
    return seen


def tokens_per_second(grpc_url: str) -> float:
    started = time.perf_counter()
    _, final = collect(grpc_url, "Count slowly from one to one hundred.", 24, chat=True)
    return final.num_output_tokens / (time.perf_counter() - started)


def test_cancelled_streams_free_the_engine(server, urls):
    """20 long streams (more than the engine's batch: some wait for a slot) cancelled mid-generation."""
    _, grpc_url = urls
    baseline = tokens_per_second(grpc_url)
    clients, texts = [], queue.Queue()
    for i in range(20):
        triton = grpcclient.InferenceServerClient(grpc_url)
        triton.start_stream(callback=lambda result, error: texts.put(error is None))
        tensors = [
            *request_tensors(f"Tell me a very long story, part {i}.", 2000),
            ("stream", np.array([[True]]), "BOOL"),
            ("end_id", np.array([[-1]], np.int32), "INT32"),
        ]
        triton.async_stream_infer("tensorrt_llm_bls", infer_inputs(grpcclient, tensors))
        clients.append(triton)
    assert texts.get(timeout=120), "the streams must be generating before they are cancelled"
    assert wait_for_in_flight(server, 20) == 20
    for triton in clients:
        triton.stop_stream(cancel_requests=True)
        triton.close()
    assert wait_for_in_flight(server, 0) == 0, "cancelled streams still hold engine slots"
    after = tokens_per_second(grpc_url)
    assert after > 0.5 * baseline, f"after cancelling, {after:.1f} tokens/s against {baseline:.1f} before"


def test_ensemble_refuses_stream(urls):
    http_url, _ = urls
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/ensemble/generate",
        method="POST",
        data=json.dumps({"text_input": "hi", "max_tokens": 4, "stream": True}).encode(),
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 400
    assert "stream" in json.loads(err.value.read())["error"]


def test_client_cli_stream(urls):
    http_url, grpc_url = urls
    command = [sys.executable, "-m", "client", "--grpc-url", grpc_url, "--stream", "-v", "-n", "24", PROMPTS["chinese"]]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip("\n") == generate(PROMPTS["chinese"], 24, url=http_url)
    assert "time to first token" in run.stderr and "tokens/s" in run.stderr
