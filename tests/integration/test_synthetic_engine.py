"""The synthetic benchmark engine behind the real models: what bench-pipeline measures is the real pipeline.

Its text goes through preprocessing, postprocessing and tensorrt_llm_bls like a model's; streamed text equals the
ensemble's and the tokenizer's decoding of the engine's own tokens; what it cannot honour is a 400 by name. Both
ways to the engine run: its default (the CUDA engine's: a process of its own, reached by several engine-model
instances and, without BLS calls, by tensorrt_llm_bls and the bridge) and in the engine model's process (BLS).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai as openai_errors
import pytest
import tritonclient.grpc as grpcclient
from openai import OpenAI

from client import GenerationError, generate, stream
from tritonllm.launch.tritonserver import OpenAIFrontend, TritonServer, free_port
from tritonllm.protocol import DECOUPLED_ENGINE_MODEL, infer_inputs
from tritonllm.repository.builder import main as build_main


@pytest.fixture(scope="module", params=["engine-process", "in-process"])
def synthetic(manifest, tmp_path_factory, request):
    build = tmp_path_factory.mktemp("synthetic")
    argv = ["--engine", "synthetic", "--model", manifest["model_dir"], "--build-dir", str(build)]
    where = ["--engine-instances", "2"] if request.param == "engine-process" else ["--no-engine-process"]
    assert build_main([*argv, *where, "--step-ms", "1", "--max-batch-size", "4", "--max-seq-len", "512"]) == 0
    server = TritonServer.on_free_ports(build, log_file=build / "server.log")
    server.start(timeout=300)
    yield server
    assert server.stop() == 0
    assert "Traceback" not in (build / "server.log").read_text()


def engine_tokens(grpc_url: str, ids: list[int], max_tokens: int) -> list[int]:
    """The engine model's own tokens for a prompt, one response."""
    tensors = [
        ("input_ids", np.array([ids], np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
        ("request_output_len", np.array([[max_tokens]], np.int32), "INT32"),
    ]
    with grpcclient.InferenceServerClient(grpc_url) as client:
        results = []
        client.start_stream(callback=lambda result, error: results.append(error or result))
        client.async_stream_infer("tensorrt_llm", infer_inputs(grpcclient, tensors))
        client.stop_stream()
    (result,) = [r for r in results if r.as_numpy("output_ids") is not None]
    return result.as_numpy("output_ids").reshape(-1)[: int(result.as_numpy("sequence_length").reshape(-1)[0])].tolist()


@pytest.mark.parametrize("max_tokens", [7, 120])
def test_streamed_text_equals_the_ensembles_and_the_decoded_tokens(synthetic, tokenizer, max_tokens):
    grpc_url = f"{synthetic.host}:{synthetic.grpc_port}"
    prompt = "Tell me about the river."
    chunks = list(stream(prompt, max_tokens, url=grpc_url, chat=False))
    whole = generate(prompt, max_tokens, url=synthetic.http_url, chat=False)
    assert "".join(c.text for c in chunks) == whole
    assert chunks[-1].num_output_tokens == max_tokens and len(chunks) > 2
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    assert whole == tokenizer.decode(engine_tokens(grpc_url, ids, max_tokens), skip_special_tokens=True)


def test_a_control_it_cannot_honour_is_refused_by_name(synthetic):
    with pytest.raises(GenerationError, match="temperature"):  # a temperature alone is greedy: top_p samples
        generate("Hello", 8, url=synthetic.http_url, temperature=0.7, top_p=0.9)


def in_own_process(server) -> bool:
    config = server.repository / DECOUPLED_ENGINE_MODEL / "1" / "synthetic_engine.json"
    return json.loads(config.read_text())["engine_process"]


def engine_model_requests(server) -> int:
    """The requests Triton handed the engine model (its inference statistics)."""
    with grpcclient.InferenceServerClient(f"{server.host}:{server.grpc_port}") as client:
        stats = client.get_inference_statistics(DECOUPLED_ENGINE_MODEL, as_json=True)
    return int(stats["model_stats"][0].get("inference_count", 0))


def test_many_streams_and_whole_answers_at_once_all_finish(synthetic):
    """With the engine in its own process, tensorrt_llm_bls and the ensemble's bridge are clients of it, not BLS
    callers of the engine model: several engine-model instances cannot deadlock them, and the engine model is handed
    none of their requests. In the engine model's process they call it through BLS."""
    grpc_url = f"{synthetic.host}:{synthetic.grpc_port}"
    before = engine_model_requests(synthetic)

    def one(index: int) -> str:
        if index % 2:
            return "".join(c.text for c in stream("Tell me", 24, url=grpc_url, chat=False))
        return generate("Tell me", 24, url=synthetic.http_url, chat=False)

    with ThreadPoolExecutor(48) as pool:
        texts = list(pool.map(one, range(192)))
    assert len(set(texts)) == 1 and texts[0]
    handed = engine_model_requests(synthetic) - before
    assert handed == 0 if in_own_process(synthetic) else handed >= 192


def test_a_stop_string_and_a_client_that_leaves_end_the_engines_work(synthetic):
    """tensorrt_llm_bls stops the engine's request at a stop string, and when its client goes away; its seat is
    then free (the batch of 4 takes the next requests at once)."""
    grpc_url = f"{synthetic.host}:{synthetic.grpc_port}"
    whole = generate("Tell me", 60, url=synthetic.http_url, chat=False)
    word = whole.split()[5]
    chunks = list(stream("Tell me", 60, url=grpc_url, chat=False, stop=[word]))
    text = "".join(c.text for c in chunks)
    assert text == whole[: whole.index(word)] and chunks[-1].finish_reason == "stop"
    for _ in range(8):  # more than the batch: each left stream's seat must come back
        left = stream("Tell me", 400, url=grpc_url, chat=False)
        next(left)
        left.close()
    assert generate("Tell me", 60, url=synthetic.http_url, chat=False, timeout=60) == whole


@pytest.fixture(scope="module")
def synthetic_openai(synthetic, tmp_path_factory):
    """The OpenAI layer in front of each build: a client of the engine's own process where there is one."""
    manifest = json.loads((synthetic.repository.parent / "manifest.json").read_text())
    openai = OpenAIFrontend.for_build(
        f"{synthetic.host}:{synthetic.grpc_port}",
        manifest,
        free_port(),
        log_file=tmp_path_factory.mktemp("openai") / "openai.log",
        repository=str(synthetic.repository),
    )
    openai.start()
    yield OpenAI(base_url=f"{openai.url}/v1", api_key="unused"), openai
    openai.stop()
    assert "Traceback" not in openai.log_file.read_text()


def test_the_openai_layer_reaches_the_engine_as_the_engine_model_does(synthetic, synthetic_openai):
    client, _ = synthetic_openai
    model = client.models.list().data[0].id
    ask = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24}
    before = engine_model_requests(synthetic)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and whole.usage.completion_tokens == 24
    assert chunks[-1].usage.completion_tokens == 24
    word = streamed.split()[2]
    stopped = client.chat.completions.create(**{**ask, "stop": [word]})
    assert (
        stopped.choices[0].finish_reason == "stop"
        and stopped.choices[0].message.content == streamed[: streamed.index(word)]
    )
    with pytest.raises(openai_errors.BadRequestError, match="temperature"):  # refused by name, as through Triton
        client.chat.completions.create(**{**ask, "temperature": 0.7, "top_p": 0.9})
    handed = engine_model_requests(synthetic) - before
    assert handed == 0 if in_own_process(synthetic) else handed >= 3
