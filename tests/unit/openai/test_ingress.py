"""Unit: what the OpenAI layer answers for bodies no hand-written client sends: deep schemas, lone surrogates,
integers past INT32, an unreadable body, a bug, and a Triton that is not ready. Never a 5xx for a client's mistake,
always OpenAI's error format."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from tests.unit.openai.conftest import MODEL
from tritonllm.openai.app import create_app
from tritonllm.openai.generation import Generator
from tritonllm.openai.models import MAX_SCHEMA_DEPTH
from tritonllm.openai.settings import Settings

USER = [{"role": "user", "content": "Hello"}]


def nested(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def post(app, path: str, body: bytes | dict, method: str = "POST") -> httpx2.Response:
    async def main():
        transport = httpx2.ASGITransport(app=app, raise_app_exceptions=False)  # as a server: the answer, not the raise
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await http.request(method, path, content=content, headers={"content-type": "application/json"})

    return asyncio.run(main())


@pytest.fixture
def app(tokenizer_dir, triton):
    settings = Settings("unused:0", tokenizer_dir, MODEL, max_input_len=512, max_seq_len=1024)
    generator = Generator(settings)
    generator._client = triton
    app = create_app(settings, generator)
    app.state.generator = generator  # for the tests that reach into it
    return app


def error_of(response: httpx2.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"], error
    return error


DEEP = nested(400)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}}, "response_format"),
        ({"guided_json": DEEP}, "guided_json"),
        ({"guided_json": "[" * 100_000 + "]" * 100_000}, "guided_json"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_a_schema_nested_too_deeply_is_a_400_naming_it(app, triton, extra, param):
    error = error_of(post(app, "/v1/chat/completions", {"model": MODEL, "messages": USER, **extra}), 400)
    assert error["param"] == param
    assert triton.requests == []


def test_a_schema_at_the_depth_limit_is_taken(app, triton):
    schema = nested(MAX_SCHEMA_DEPTH // 2 - 1)  # each level is two objects: itself and its properties
    response = post(app, "/v1/chat/completions", {"model": MODEL, "messages": USER, "guided_json": schema})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": ["\\udfff"]}', "stop"),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "user": "\\ud800"}',
            "user",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(app, triton, path, body, param):
    error = error_of(post(app, path, body), 400)
    assert error["param"] == param and "surrogate" in error["message"], error
    assert triton.requests == []


def test_a_surrogate_pair_is_text(app, triton):
    response = post(app, "/v1/completions", b'{"model": "tiny", "prompt": "Hello \\ud83d\\ude00"}')
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("field", ["top_k", "min_tokens", "max_tokens"])
def test_an_integer_past_int32_is_a_400_naming_it(app, field):
    error = error_of(post(app, "/v1/completions", {"model": MODEL, "prompt": "Hello", field: 2**63}), 400)
    assert error["param"] == field


def test_an_unreadable_body_is_a_400_in_openais_format(app):
    error_of(post(app, "/v1/completions", b"\x80\x00"), 400)


def test_an_unknown_route_and_a_wrong_method_are_in_openais_format(app):
    assert error_of(post(app, "/v1/nothing", {}), 404)["type"]
    error_of(post(app, "/v1/completions", b"", method="GET"), 405)


def test_a_bug_is_a_500_in_openais_format(app, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Generator, "budget", broken)
    error = error_of(post(app, "/v1/completions", {"model": MODEL, "prompt": "Hello"}), 500)
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]


@pytest.mark.parametrize(("ready", "status"), [(True, 200), (False, 503)])
def test_health_is_503_until_triton_is_ready(app, triton, ready, status):
    async def is_server_ready() -> bool:
        return ready

    triton.is_server_ready = is_server_ready
    response = post(app, "/health", b"", method="GET")
    assert response.status_code == status and response.json() == {"ready": ready}


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(app):
    from tritonllm.openai.app import BodyLimit

    limited = BodyLimit(app, 1000)
    body = {"model": MODEL, "prompt": "Hello " * 400}
    assert error_of(post(limited, "/v1/completions", body), 413)["type"] == "invalid_request_error"

    async def chunked():
        async def chunks():
            for _ in range(5):
                yield b" " * 400
            yield json.dumps(body).encode()

        transport = httpx2.ASGITransport(app=limited)
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})

    assert asyncio.run(chunked()).status_code == 413
    small = post(limited, "/v1/completions", {"model": MODEL, "prompt": "Hello"})
    assert small.status_code == 200, small.text


def test_too_many_choices_are_a_400_naming_the_prompt(app, triton):
    error = error_of(post(app, "/v1/completions", {"model": MODEL, "prompt": ["Hello"] * 65, "n": 2}), 400)
    assert error["param"] == "prompt" and triton.requests == []


def test_a_prompt_over_the_byte_limit_is_refused_without_tokenizing(app, triton, monkeypatch):
    from tritonllm.text.tokenization import MAX_BYTES_PER_TOKEN

    calls = []
    monkeypatch.setattr(app.state.generator, "tokenizer", lambda *args, **kwargs: calls.append(args))
    prompt = "x" * (MAX_BYTES_PER_TOKEN * 512 + 1)
    error = error_of(post(app, "/v1/completions", {"model": MODEL, "prompt": prompt}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert calls == [] and triton.requests == []


def test_prompts_are_tokenized_off_the_event_loop(app, monkeypatch):
    import threading

    threads = []
    budget = Generator.budget

    def recorded(self, *args):
        threads.append(threading.current_thread())
        return budget(self, *args)

    monkeypatch.setattr(Generator, "budget", recorded)
    assert post(app, "/v1/completions", {"model": MODEL, "prompt": "Hello"}).status_code == 200
    assert post(app, "/v1/chat/completions", {"model": MODEL, "messages": USER}).status_code == 200
    assert len(threads) == 2 and threading.main_thread() not in threads
