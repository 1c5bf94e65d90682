"""Integration: the OpenAI-compatible layer, driven with the official `openai` client, as users do."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from client import generate, infer_inputs, request_tensors
from tests.integration.test_server import loads_torch
from tests.integration.test_streaming import wait_for_in_flight
from tritonllm.protocol import DECOUPLED_ENGINE_MODEL, MAX_WORD_BYTES, STREAMING_MODEL

pytestmark = pytest.mark.integration
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def base_url(openai_frontend) -> str:
    return openai_frontend()


@pytest.fixture(scope="module")
def api(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(api) -> str:
    return api.models.list().data[0].id


def chat(api, model, content=QUESTION, **options):
    return api.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **options)


def stream_chat(api, model, content=QUESTION, **options) -> tuple[str, list]:
    chunks = list(chat(api, model, content, stream=True, **options))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models(api, manifest, model):
    assert model == manifest["tokenizer_dir"].rstrip("/").split("/")[-1]
    assert api.models.retrieve(model).id == model


def test_the_layer_runs_its_workers_and_loads_no_torch(base_url, model):
    """The fixture asks for two worker processes (uvicorn's, under the process started): both serve, neither
    loads torch, nor does the process that supervises them."""
    port = base_url.rsplit(":", 1)[1].split("/")[0]
    pids = subprocess.run(["pgrep", "-f", "tritonllm.openai.app"], capture_output=True, text=True).stdout.split()
    [pid] = [pid for pid in pids if f"--port\0{port}\0".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]
    children = subprocess.run(["pgrep", "-P", pid], capture_output=True, text=True).stdout.split()
    workers = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(workers) == 2, children
    assert not any(loads_torch(int(p)) for p in [pid, *workers])

    # Each worker listens on a socket of its own (openai/workers.py), not on one the supervisor shares; the layer
    # answers once one worker does, so the other may still be loading its app.
    def own() -> list[list[str]]:
        return [listening_sockets(w, int(port)) for w in workers]

    deadline = time.monotonic() + 120
    while [len(inodes) for inodes in own()] != [1, 1] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert listening_sockets(pid, int(port)) == []
    assert len({inode for inodes in own() for inode in inodes}) == 2, own()


def listening_sockets(pid: str, port: int) -> list[str]:
    """The socket inodes on which process `pid` listens on TCP `port` (from /proc)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                listening.add(fields[9])
    links = (os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir() if f.is_symlink())
    return [inode for link in links if (inode := link.removeprefix("socket:[").rstrip("]")) in listening]


def test_choices_stream_from_the_engine_model_not_through_tensorrt_llm_bls(api, model, server, manifest):
    """With the repository at hand the layer runs each choice's pipeline itself (openai/engine_stream.py)."""

    def counts() -> dict[str, int]:
        with httpclient.InferenceServerClient(server.http_url.removeprefix("http://")) as triton:
            stats = triton.get_inference_statistics()["model_stats"]
        return {s["name"]: int(s["inference_stats"]["success"]["count"]) for s in stats}

    before = counts()
    text, _ = stream_chat(api, model, max_tokens=16, stop=["Paris"])
    after = counts()
    assert after[STREAMING_MODEL] == before[STREAMING_MODEL]
    assert after[manifest["engine_model"]] > before[manifest["engine_model"]]
    assert "Paris" not in text


def test_chat_equals_the_ensemble(api, model, tokenizer, server):
    answer = chat(api, model, max_tokens=24)
    assert answer.choices[0].message.content == generate(QUESTION, 24, url=server.http_url)
    assert answer.choices[0].message.role == "assistant"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert answer.choices[0].finish_reason == "stop"  # the model ended the sentence


def test_usage_says_how_much_of_a_repeated_prompt_the_prefix_cache_served(api, model, manifest):
    prompt = "A prompt told twice: the second time its tokens' cache is there already."
    api.completions.create(model=model, prompt=prompt, max_tokens=2)
    again = api.completions.create(model=model, prompt=prompt, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    if manifest["engine_config"].get("prefix_cache"):  # all but the last token, which is computed for its logits
        assert cached == again.usage.prompt_tokens - 1
    else:
        assert cached == 0


def test_chat_stream_equals_non_stream(api, model):
    whole = chat(api, model, content="Write two sentences about the sea.", max_tokens=20)
    text, chunks = stream_chat(
        api, model, content="Write two sentences about the sea.", max_tokens=20, stream_options={"include_usage": True}
    )
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert whole.usage.completion_tokens == 20


def test_completions_stream_and_not(api, model, server):
    prompt = "The three primary colors are"
    whole = api.completions.create(model=model, prompt=prompt, max_tokens=12)
    assert whole.choices[0].text == generate(prompt, 12, url=server.http_url, chat=False)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    streamed = "".join(
        c.choices[0].text
        for c in api.completions.create(model=model, prompt=prompt, max_tokens=12, stream=True)
        if c.choices
    )
    assert streamed == whole.choices[0].text


@pytest.mark.parametrize("stop", ["Paris", ["is Par", "zebra"]])
def test_stop_sequences(api, model, stop):
    answer = chat(api, model, max_tokens=24, stop=stop)
    content = answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"
    assert "Paris" not in content and content.startswith("The capital of France")
    text, _ = stream_chat(api, model, max_tokens=24, stop=stop)
    assert text == content


def test_seeded_sampling_and_n(api, model):
    first = chat(api, model, content="Write a short poem.", max_tokens=12, temperature=0.9, seed=5, n=2)
    again = chat(api, model, content="Write a short poem.", max_tokens=12, temperature=0.9, seed=5, n=2)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1]
    single = chat(api, model, content="Write a short poem.", max_tokens=12)
    assert first.usage.prompt_tokens == single.usage.prompt_tokens, "the prompt is counted once, not per choice"
    assert first.usage.completion_tokens == 24


def test_errors_in_openai_format(api, model):
    with pytest.raises(openai.NotFoundError) as err:
        chat(api, "no-such-model", max_tokens=4)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        chat(api, model, max_tokens=4, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        chat(api, model, max_tokens=4, top_p=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        chat(api, model, max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match=r"maximum context length|input tokens"):
        api.completions.create(model=model, prompt="word " * 5000, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="messages"):
        api.chat.completions.create(model=model, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        chat(api, model, max_tokens=4, presence_penalty=2.5)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        chat(api, model, max_tokens=4, logprobs=True, top_logprobs=21)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_the_models_would_refuse_are_400_naming_stop(api, model, stream):
    for stop in ("z" * (MAX_WORD_BYTES + 1), ["a", "b", "c", "d", "e"]):
        with pytest.raises(openai.BadRequestError) as err:
            chat(api, model, max_tokens=4, stop=stop, stream=stream)
        assert err.value.body["param"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_mistake_inside_the_stream_is_400(api, model, stream):
    """A whitespace prompt passes this layer's checks and is refused by the preprocessing model, inside
    the gRPC stream: the kind tag, not the wording or a status code, makes it a 400 (not a 500, nor a
    200 stream that carries the error)."""
    with pytest.raises(openai.BadRequestError, match="text_input") as err:
        answer = api.completions.create(model=model, prompt="  \n ", max_tokens=4, stream=stream)
        list(answer) if stream else None
    assert err.value.status_code == 400 and err.value.body["type"] == "invalid_request_error"


def test_api_key(openai_frontend, model):
    url = openai_frontend(api_key="s3cret")
    for key in ("wrong", ""):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0).models.list()
    request = urllib.request.Request(f"{url}/models")  # no Authorization header at all
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 401
    good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
    assert good.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)


def test_sixteen_concurrent_streaming_chats(api, model):
    prompts = [f"Name an animal that starts with {chr(65 + i)}." for i in range(16)]
    expected = [chat(api, model, content=p, max_tokens=10).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        streamed = list(pool.map(lambda p: stream_chat(api, model, content=p, max_tokens=10)[0], prompts))
    assert streamed == expected


def test_disconnect_cancels_the_generation(api, model, server):
    assert wait_for_in_flight(server, 0) == 0
    stream = chat(api, model, content="Tell me a very long story.", max_tokens=3000, stream=True)
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    assert wait_for_in_flight(server, 1) == 1  # the gauge is refreshed every 0.2 s
    stream.close()  # the client goes away mid-stream
    assert wait_for_in_flight(server, 0) == 0, "the engine still generates for a client that left"


def test_clients_dropping_streams_under_load_get_no_429(base_url, model, server):
    """64 streamed chats, 32 at a time, about one in six dropped by its client after 3 chunks. A dropped stream
    holds its engine seat until its cancellation arrives; with a queue only as long as the batch (16 + 16 seats),
    every chat arriving in that moment was refused at once, and the 32 clients burned through the rest as 429s."""

    async def load() -> dict[str, int]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
        counts = {"finished": 0, "dropped": 0, "busy": 0}
        jobs = iter(range(64))

        async def one(i: int) -> None:
            messages = [{"role": "user", "content": f"Tell me a story, number {i}."}]
            try:
                stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, stream=True)
            except openai.RateLimitError:
                counts["busy"] += 1
                return
            chunks = 0
            async for _chunk in stream:
                chunks += 1
                if i % 6 == 5 and chunks == 3:
                    await stream.close()
                    counts["dropped"] += 1
                    return
            counts["finished"] += 1

        async def worker() -> None:
            for i in jobs:
                await one(i)

        try:
            await asyncio.gather(*(worker() for _ in range(32)))
        finally:
            await client.close()
        return counts

    counts = asyncio.run(load())
    assert counts == {"finished": 54, "dropped": 10, "busy": 0}
    assert wait_for_in_flight(server, 0) == 0


def test_server_busy_is_429_and_cancels_the_refused_choices_siblings(api, model, server):
    """More requests than the engine admits (max_batch_size + max_queue_size): the next one is refused,
    streamed or not. Choices run together, so one refused must cancel its admitted siblings, which
    would otherwise hold the engine's places until max_tokens."""
    engine = f"http://{server.http_url}/v2/models/{DECOUPLED_ENGINE_MODEL}/config"  # the engine admits
    config = urllib.request.urlopen(engine, timeout=30).read()
    capacity = int(re.search(rb'"max_batch_size":\s*(\d+)', config).group(1))
    capacity += int(re.search(rb'"max_queue_size":\{"string_value":"(\d+)"', config).group(1))
    clients = []

    def occupy(count: int) -> None:
        for _ in range(count):
            triton = grpcclient.InferenceServerClient(f"{server.host}:{server.grpc_port}")
            triton.start_stream(callback=lambda result, error: None)
            tensors = [
                *request_tensors(f"Story {len(clients)}.", 2000),
                ("stream", np.array([[True]]), "BOOL"),
                ("end_id", np.array([[-1]], np.int32), "INT32"),
            ]
            triton.async_stream_infer("tensorrt_llm_bls", infer_inputs(grpcclient, tensors))
            clients.append(triton)

    try:
        occupy(capacity - 2)
        assert wait_for_in_flight(server, capacity - 2) == capacity - 2
        counting = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy decoding keeps counting up to max_tokens
        with pytest.raises(openai.RateLimitError, match="server busy"):  # two choices admitted, the third refused
            api.completions.create(model=model, prompt=[counting] * 3, max_tokens=2000)
        time.sleep(1)  # the gauge is refreshed every 0.2 s
        assert wait_for_in_flight(server, capacity - 2, timeout=10) == capacity - 2, "the siblings still generate"
        occupy(2)
        assert wait_for_in_flight(server, capacity) == capacity
        for stream in (False, True):  # a refused stream answers 429 too, not a 200 that carries the error
            with pytest.raises(openai.RateLimitError, match="server busy") as err:
                list(chat(api, model, max_tokens=4, stream=True)) if stream else chat(api, model, max_tokens=4)
            assert err.value.body["type"] == "rate_limit_exceeded" and err.value.body["code"] == "server_busy"
    finally:
        for triton in clients:
            triton.stop_stream(cancel_requests=True)
            triton.close()
    assert wait_for_in_flight(server, 0) == 0
    time.sleep(0.5)
    assert chat(api, model, max_tokens=4).choices[0].message.content
