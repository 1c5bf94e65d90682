"""Integration: the LLM API flavor (build_engines.py --engine trtllm-llmapi) served by a real tritonserver, for each
release it runs on, with the stand-in of that release's LLM API (tests/standins/tensorrt_llm) in place of the real
one, which needs an NVIDIA GPU and NVIDIA's image. The stand-in runs the built model through llama.cpp, so every
answer here must equal the portable flavor's on the same model: what differs between the flavors is only the engine
adapter.

Driven as users drive it: the example client, NVIDIA's client scripts' requests (tests/integration/reference_clients.py)
and the official `openai` client.
"""

from __future__ import annotations

import json

import pytest

from client import generate, stream
from tests.conftest import BUILD, ROOT, openai_client
from tests.integration.reference_clients import EndToEnd, InflightBatcher, run_end_to_end, run_inflight_batcher
from tritonllm.versions import LLM_API_RELEASES

pytestmark = pytest.mark.integration
QUESTION = "What is the capital of France?"
STANDIN = ROOT / "tests" / "standins" / "tensorrt_llm"


@pytest.fixture(scope="module", params=list(LLM_API_RELEASES))
def release(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llmapi_server(tmp_path_factory, manifest, release):
    """A tritonserver on an LLM API build of the default model for `release`, whose `import tensorrt_llm` finds the
    stand-in of that release."""
    from tests.conftest import _served
    from tritonllm.repository.builder import main as build_main

    build = tmp_path_factory.mktemp("llmapi")
    options = ["--model", manifest["model_dir"], "--build-dir", str(build), "--llm-api-release", release]
    assert build_main(["--engine", "trtllm-llmapi", *options]) == 0
    # The Python backend's stub puts the model's version folder on sys.path (it ignores PYTHONPATH): the stand-in
    # package goes there, beside the engine model's llm_api.json.
    (build / "model_repository" / "tensorrt_llm_decoupled" / "1" / "tensorrt_llm").symlink_to(STANDIN)
    served = _served(build, tmp_path_factory)
    with pytest.MonkeyPatch.context() as patch:  # the server's environment: tritonllm.launch.pytriton_wheel.server_env
        patch.setenv("TRITONLLM_STANDIN_ENGINE", str(BUILD / "model_repository" / "tensorrt_llm_decoupled" / "1"))
        patch.setenv("TRITONLLM_STANDIN_RELEASE", release)
        server = next(served)  # started
    yield server
    for _ in served:  # stops it, and checks its log
        pass


@pytest.fixture(scope="module")
def llmapi_manifest(llmapi_server) -> dict:
    return json.loads((llmapi_server.repository.parent / "manifest.json").read_text())


def test_the_ensemble_and_the_bls_answer_as_the_portable_flavor(llmapi_server, llmapi_manifest, server, release):
    assert (llmapi_manifest["engine"], llmapi_manifest["llm_api_release"]) == ("trtllm-llmapi", release)
    assert f"TensorRT-LLM {LLM_API_RELEASES[release].trtllm} LLM API engine" in llmapi_server.log_file.read_text()
    expected = generate(QUESTION, 24, url=server.http_url)
    assert generate(QUESTION, 24, url=llmapi_server.http_url) == expected
    streamed = "".join(c.text for c in stream(QUESTION, 24, url=f"{llmapi_server.host}:{llmapi_server.grpc_port}"))
    assert streamed == expected


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "seed": 3, "presence_penalty": 0.6, "frequency_penalty": 0.4},
        {"temperature": 0.5, "presence_penalty": 0.6, "repetition_penalty": 1.3, "min_tokens": 12},  # greedy
        {"presence_penalty": 0.5, "openai_penalties": True, "temperature": 0.9, "top_k": 20, "seed": 5},
    ],
    ids=["sampled", "greedy-with-a-temperature", "openai-penalties"],
)
def test_sampling_and_penalties_reach_the_model_as_in_the_portable_flavor(llmapi_server, server, options):
    """The LLM API's names and rules (the temperature before presence and frequency, the prompt's tokens counted
    unless OpenAI's rule) translated back by the stand-in give the portable engine's draw on the same seed."""
    expected = generate(QUESTION, 16, url=server.http_url, **options)
    assert generate(QUESTION, 16, url=llmapi_server.http_url, **options) == expected


def test_nvidias_clients_are_answered(llmapi_server, server, tokenizer, manifest):
    """end_to_end_grpc_client.py's controls (stop words, log probs) and inflight_batcher_llm_client.py's token ids."""
    urls = [f"{s.host}:{s.grpc_port}" for s in (llmapi_server, server)]
    options = EndToEnd(QUESTION, output_len=24, temperature=0.0, return_log_probs=True, stop_words=["Paris"])
    ours, portable = (run_end_to_end(url, options) for url in urls)
    assert not ours.errors and ours.texts == portable.texts
    unstopped = run_end_to_end(urls[0], EndToEnd(QUESTION, output_len=24, temperature=0.0)).texts[0]
    assert "Paris" in unstopped and len(ours.texts[0]) < len(unstopped)  # the stop word ended it
    log_probs = ours.responses[0].as_numpy("output_log_probs")
    assert log_probs.size and (log_probs <= 0).all()
    batcher = InflightBatcher(manifest["tokenizer_dir"], text=QUESTION, request_output_len=12)
    ours, portable = (run_inflight_batcher(url, batcher, tokenizer) for url in urls)
    assert ours.output_ids == portable.output_ids and len(ours.output_ids[0]) > len(ours.input_ids)


@pytest.fixture(scope="module")
def api(llmapi_server, llmapi_manifest, tmp_path_factory):
    yield from openai_client(llmapi_server, llmapi_manifest, tmp_path_factory)


def chat(api, **options):
    model = api.models.list().data[0].id
    return api.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], **options)


def test_openai_chat_streams_the_same_text_with_usage_and_log_probs(api):
    whole = chat(api, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    chunks = list(chat(api, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    positions = whole.choices[0].logprobs.content
    assert positions and all(len(p.top_logprobs) == 2 and p.logprob <= 0 for p in positions)


def test_openai_n_choices_and_json_mode(api):
    sampled = chat(api, max_tokens=12, temperature=0.8, seed=3, n=2)
    assert [c.index for c in sampled.choices] == [0, 1] and all(c.message.content for c in sampled.choices)
    answer = chat(api, max_tokens=48, temperature=0, response_format={"type": "json_object"})
    if answer.choices[0].finish_reason == "stop":
        json.loads(answer.choices[0].message.content)
    else:
        assert answer.choices[0].message.content.lstrip().startswith(("{", "["))
