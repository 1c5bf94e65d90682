"""Integration: hypothesis generates KServe bodies (HTTP `generate` and `infer`) for a real server.

The rule: no 5xx for anything a client sends, except the bodies tritonserver 2.51's own JSON parser rejects before
any model runs (docs/api.md, "Bad input": its 500 carries the parser's wording, matched here); the server stays
ready, and a valid request afterwards gets the same answer. `TRITONLLM_FUZZ_EXAMPLES` sets the cases per property
(`make fuzz` runs many more; make test a short run, the same every time).
"""

from __future__ import annotations

import json
import os

import hypothesis
import pytest
import tritonclient.http as httpclient
from hypothesis import strategies as st

from client import generate
from tests.integration.test_bad_input import post

pytestmark = pytest.mark.integration
EXAMPLES = int(os.environ.get("TRITONLLM_FUZZ_EXAMPLES", "40"))
# What tritonserver 2.51's HTTP front answers with a 5xx itself, in its own words: 500 for JSON it cannot parse or a
# JSON value of another type than the input's (src/http_server.cc; triton-inference-server/server#8773 asks for
# 400s), 501 for `/infer` on a decoupled model (streaming needs `generate_stream` or gRPC).
CORE_5XX = {
    500: ("failed to parse the request json", "attempt to access json non-", "unable to parse"),
    501: ("doesn't support models with decoupled transaction policy",),
}

SETTINGS = hypothesis.settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 100,
    suppress_health_check=list(hypothesis.HealthCheck),
    database=None,
)

texts = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "Hi", "写一首诗", "\x00", "a" * 5000]))
numbers = st.one_of(
    st.integers(-3, 4),
    st.sampled_from([0, -1, 2**31 - 1, 2**31, -(2**31), 2**63, 5000]),
    st.floats(allow_nan=False),
    st.sampled_from([float("inf"), 1e300]),
)
values = st.one_of(texts, numbers, st.booleans(), st.none(), st.lists(st.one_of(texts, st.integers()), max_size=3))
FIELDS = {
    "text_input": st.one_of(texts, values),
    "max_tokens": st.one_of(st.integers(1, 4), numbers, values),
    "temperature": st.one_of(st.floats(0, 2), values),
    "top_k": st.one_of(st.integers(0, 50), values),
    "top_p": st.one_of(st.floats(0, 1), values),
    "seed": st.one_of(st.integers(0, 2**64 - 1), values),
    "min_tokens": st.one_of(st.integers(0, 4), values),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), values),
    "stop_words": st.one_of(st.lists(texts, max_size=3), values),
    "bad_words": st.one_of(st.lists(texts, max_size=3), values),
    "apply_chat_template": st.one_of(st.booleans(), values),
    "end_id": st.one_of(st.integers(-2, 60000), values),
    "return_log_probs": st.one_of(st.booleans(), values),
    "num_return_sequences": st.one_of(st.integers(0, 3), values),
    "stream": st.one_of(st.booleans(), values),
    "no_such_input": values,
}


@st.composite
def generate_bodies(draw) -> bytes:
    body = {"text_input": draw(texts), "max_tokens": draw(st.integers(1, 4))}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True)):
        body[name] = draw(FIELDS[name])
    if draw(st.booleans()) and len(body) > 1:
        del body[draw(st.sampled_from(sorted(body)))]
    raw = json.dumps(body).encode()
    if draw(st.integers(0, 9)) == 0:  # now and then, a cut or garbled body
        raw = raw[: draw(st.integers(0, len(raw)))] + draw(st.binary(max_size=4))
    return raw


DATATYPES = ["BYTES", "INT32", "INT64", "UINT64", "FP32", "FP16", "BOOL", "INT8", "NOPE"]


@st.composite
def infer_bodies(draw) -> bytes:
    inputs = []
    for name in draw(st.lists(st.sampled_from(["text_input", "max_tokens", *sorted(FIELDS)]), max_size=4, unique=True)):
        shape = draw(st.lists(st.integers(-1, 3), min_size=0, max_size=3))
        data = draw(st.lists(st.one_of(texts, numbers, st.booleans()), max_size=6))
        inputs.append({"name": name, "datatype": draw(st.sampled_from(DATATYPES)), "shape": shape, "data": data})
    return json.dumps({"inputs": inputs}).encode()


def holds(got: int, text: str) -> None:
    if got >= 500:
        assert any(words in text.lower() for words in CORE_5XX.get(got, ())), (got, text[:2000])


@pytest.fixture(scope="module")
def expected(server) -> str:
    return generate("What is the capital of France?", 8, url=server.http_url)


@pytest.mark.parametrize("path", ["/v2/models/ensemble/generate", "/v2/models/tensorrt_llm_bls/generate_stream"])
def test_fuzzed_generate_bodies_are_never_a_5xx_of_ours(server, expected, path):
    @hypothesis.given(generate_bodies())
    @SETTINGS
    def check(body: bytes) -> None:
        holds(*post(server, path, body))

    check()
    assert_unchanged(server, expected)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls", "preprocessing", "postprocessing"])
def test_fuzzed_infer_tensors_are_never_a_5xx_of_ours(server, expected, model):
    @hypothesis.given(infer_bodies())
    @SETTINGS
    def check(body: bytes) -> None:
        holds(*post(server, f"/v2/models/{model}/infer", body))

    check()
    assert_unchanged(server, expected)


def assert_unchanged(server, expected: str) -> None:
    with httpclient.InferenceServerClient(server.http_url) as triton:
        assert triton.is_server_ready()
    assert generate("What is the capital of France?", 8, url=server.http_url) == expected
