"""Unit: schemathesis against the OpenAI layer's own OpenAPI document, every route, valid and invalid bodies.

The rule it holds the layer to: no 5xx for anything a client sends, and every error in OpenAI's format. The app runs
in-process over a stand-in Triton (conftest.py), so the cases cost milliseconds; `TRITONLLM_FUZZ_EXAMPLES` sets how
many per route and mode (`make fuzz` runs many more and explores; CI a short run, the same every time).
"""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

import hypothesis
import pytest
import schemathesis
from schemathesis.generation import GenerationMode

from tests.unit.openai.conftest import MODEL, FakeTriton, make_tokenizer
from tritonllm.openai.app import create_app
from tritonllm.openai.generation import Generator
from tritonllm.openai.settings import Settings

EXAMPLES = int(os.environ.get("TRITONLLM_FUZZ_EXAMPLES", "30"))


class ReadyTriton(FakeTriton):
    async def is_server_ready(self) -> bool:
        return True


def fuzzed_app(folder: Path):
    settings = Settings("unused:0", make_tokenizer(folder), MODEL, max_input_len=512, max_seq_len=1024)
    generator = Generator(settings)
    generator._client = ReadyTriton()
    return create_app(settings, generator)


SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app(Path(tempfile.mkdtemp(prefix="fuzz-tokenizer-"))))
OPERATIONS = {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in SCHEMA.get_all_operations())}


def test_every_route_is_fuzzed():
    assert {"GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions", "GET /health"} <= set(OPERATIONS)


def served(case):
    """Most valid bodies name the served model, so that they get past the model check to the rest of the layer."""
    if isinstance(case.body, dict) and "model" in case.body and zlib.crc32(repr(case.body).encode()) % 8:
        case.body["model"] = MODEL
    return case


# Negative cases need something to break: the routes with a body (a path parameter takes any string).
CASES = [(route, GenerationMode.POSITIVE) for route in OPERATIONS]
CASES += [(route, GenerationMode.NEGATIVE) for route, op in OPERATIONS.items() if op.body]


@pytest.mark.parametrize(("route", "mode"), CASES, ids=[f"{r}-{m.value}" for r, m in CASES])
def test_no_client_input_is_a_5xx(route, mode):
    @hypothesis.given(OPERATIONS[route].as_strategy(generation_mode=mode).map(served))
    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=EXAMPLES <= 100,
        suppress_health_check=list(hypothesis.HealthCheck),
        database=None,
    )
    def holds(case):
        response = case.call()
        assert response.status_code < 500, (case.path, case.body, response.status_code, response.text[:2000])
        if response.status_code >= 400:
            error = response.json().get("error") or {}
            assert error.get("message") and error.get("type"), (
                case.path,
                case.headers,
                case.body,
                response.status_code,
                response.text,
            )

    holds()
