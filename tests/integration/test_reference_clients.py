"""Integration: NVIDIA's own client scripts' requests (tests/integration/reference_clients.py) against our server,
in both of NVIDIA's deployments.

Default deployment (NVIDIA's decoupled_mode false): `ensemble` and `tensorrt_llm` answer request/response (gRPC
ModelInfer, HTTP /infer), so inflight_batcher_llm_client.py without `-S` is answered; `-S` and `-n` > 1 on
tensorrt_llm, and `stream` on ensemble, are refused naming the build option that serves them. `tensorrt_llm_bls`
streams text. Decoupled deployment (--decoupled-mode): `tensorrt_llm` is the engine and streams, and so does the
ensemble, with a response per sequence and per batch row; unary calls are refused by Triton, as NVIDIA's.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from tests.integration.reference_clients import (
    EndToEnd,
    InflightBatcher,
    end_to_end_inputs,
    end_to_end_outputs,
    grpc_input,
    inflight_batcher_inputs,
    run_end_to_end,
    run_inflight_batcher,
)
from tritonllm.protocol import DRAFT_OUTPUTS, PERF_OUTPUTS, TIMING_OUTPUTS

pytestmark = pytest.mark.integration

PROMPT = "What is the year after 2024? Answer:"  # the prompt of NVIDIA's guided-decoding walkthrough


@pytest.fixture(scope="module")
def grpc_url(server) -> str:
    return f"{server.host}:{server.grpc_port}"


def spec(arrays: dict[str, np.ndarray]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (array.dtype.kind, array.shape) for name, array in arrays.items()}


# ------------------------------------------------------------------ what the scripts send (no server)


def test_end_to_end_default_command_line_sends_these_tensors():
    arrays = end_to_end_inputs(EndToEnd(PROMPT))
    assert spec(arrays) == {
        "text_input": ("O", (1, 1)),
        "max_tokens": ("i", (1, 1)),
        "stream": ("b", (1, 1)),
        "beam_width": ("i", (1, 1)),
        "temperature": ("f", (1, 1)),
        "exclude_input_in_output": ("b", (1, 1)),
    }
    assert (arrays["max_tokens"][0, 0], arrays["beam_width"][0, 0], arrays["temperature"][0, 0]) == (100, 1, 1.0)
    assert not arrays["stream"][0, 0] and not arrays["exclude_input_in_output"][0, 0]
    assert end_to_end_outputs(EndToEnd(PROMPT)) == ["text_output"]


def test_end_to_end_control_options_send_these_tensors():
    options = EndToEnd(
        PROMPT,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        stop_words=["a", "b"],
        bad_words=["c"],
        embedding_bias_words=["x", "y"],
        embedding_bias_weights=["-1.5", "2"],
        return_log_probs=True,
        end_id=2,
        pad_id=2,
        guided_decoding_guide_type="regex",
        guided_decoding_guide=r"\d+",
    )
    arrays = end_to_end_inputs(options)
    assert spec(arrays)["stop_words"] == ("O", (1, 2)) and spec(arrays)["bad_words"] == ("O", (1, 1))
    assert (
        arrays["embedding_bias_weights"].tolist() == [[-1.5, 2.0]]
        and arrays["embedding_bias_weights"].dtype == np.float32
    )
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert spec(arrays)[name] == ("f", (1, 1))
    for name in ("end_id", "pad_id"):
        assert spec(arrays)[name] == ("i", (1, 1))
    assert spec(arrays)["return_log_probs"] == ("b", (1, 1))
    assert spec(arrays)["guided_decoding_guide_type"] == ("O", (1, 1))
    assert end_to_end_outputs(options) == ["text_output", "cum_log_probs", "output_log_probs"]


def test_inflight_batcher_default_command_line_sends_these_tensors():
    arrays = inflight_batcher_inputs(InflightBatcher("unused"), [5, 6, 7], end_id=2, pad_id=2)
    assert list(arrays) == [
        "input_ids",
        "input_lengths",
        "request_output_len",
        "beam_width",
        "temperature",
        "streaming",
        "end_id",
        "pad_id",
        "runtime_top_k",
        "runtime_top_p",
    ]
    assert spec(arrays)["input_ids"] == ("i", (1, 3)) and arrays["input_lengths"].tolist() == [[3]]
    assert (arrays["request_output_len"][0, 0], arrays["runtime_top_k"][0, 0], arrays["runtime_top_p"][0, 0]) == (
        16,
        1,
        0.0,
    )


# ------------------------------------------------------------------ end_to_end_grpc_client.py on our server


def answer(grpc_url: str, options: EndToEnd) -> str:
    result = run_end_to_end(grpc_url, options)
    assert not result.errors, [e.message() for e in result.errors]
    assert len(result.texts) == 1
    return result.texts[0]


def completion(grpc_url: str, **options) -> str:
    """The generated text only (--exclude-input-in-output, as in NVIDIA's guided-decoding walkthrough)."""
    return answer(grpc_url, EndToEnd(PROMPT, exclude_input_in_output=True, **options))


@pytest.mark.parametrize("model_name", ["ensemble", "tensorrt_llm_bls"])
def test_end_to_end_default_request(grpc_url, model_name):
    """The script sends exclude_input_in_output=false: the text is the prompt, then the completion. Its default
    temperature 1.0 comes without top_k or top_p, which TensorRT-LLM decodes greedily: so two runs agree, which
    the script's --check-outputs flow (a run, then a second compared with it) relies on."""
    options = EndToEnd(PROMPT, output_len=24, model_name=model_name)
    text = answer(grpc_url, options)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    assert answer(grpc_url, options) == text


@pytest.mark.parametrize("model_name", ["ensemble", "tensorrt_llm_bls"])
def test_end_to_end_default_request_greedy(grpc_url, model_name):
    text = answer(grpc_url, EndToEnd(PROMPT, output_len=24, temperature=0.0, model_name=model_name))
    assert text.startswith(PROMPT) and len(text.strip()) > len(PROMPT)


def test_end_to_end_exclude_input_in_output(grpc_url):
    text = completion(grpc_url, output_len=24, temperature=0.0)
    assert text.strip() and not text.startswith(PROMPT)


@pytest.mark.parametrize(
    "options",
    [
        {"beam_width": 1},
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.8},
        {"frequency_penalty": 0.8},
        {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"bad_words": ["the", "The"]},
        {"pad_id": 2},
    ],
    ids=lambda o: ",".join(o),
)
def test_end_to_end_control_options(grpc_url, options):
    """Each option with --temperature 0 (the script has no top_k option), so the text is the greedy one."""
    assert completion(grpc_url, output_len=24, temperature=0.0, **options).strip()


def test_end_to_end_stop_words(grpc_url):
    text = completion(grpc_url, output_len=48, temperature=0.0, stop_words=["."])
    assert "." not in text.rstrip(".")


def test_end_to_end_end_id(grpc_url, tokenizer):
    """--end-id with the tokenizer's end: the model's own end stops it, as without the flag."""
    greedy = completion(grpc_url, output_len=48, temperature=0.0)
    assert completion(grpc_url, output_len=48, temperature=0.0, end_id=tokenizer.eos_token_id) == greedy


def test_end_to_end_embedding_bias_words(grpc_url):
    prompt = "The capital of France is the city of"
    plain = answer(grpc_url, EndToEnd(prompt, output_len=12, temperature=0.0, exclude_input_in_output=True))
    assert "Paris" in plain, "the premise: greedy, the model names Paris"
    biased = answer(
        grpc_url,
        EndToEnd(
            prompt,
            output_len=12,
            temperature=0.0,
            exclude_input_in_output=True,
            embedding_bias_words=["Paris", " Paris"],
            embedding_bias_weights=["-100", "-100"],
        ),
    )
    assert biased.strip() and "Paris" not in biased


def test_end_to_end_return_log_probs(grpc_url):
    options = EndToEnd(PROMPT, output_len=16, temperature=0.0, exclude_input_in_output=True, return_log_probs=True)
    result = run_end_to_end(grpc_url, options)
    assert not result.errors and result.texts[0].strip()
    (response,) = result.responses
    output_log_probs = response.as_numpy("output_log_probs")  # the script prints its shape and values
    cum_log_probs = response.as_numpy("cum_log_probs")
    assert output_log_probs.ndim == 3 and output_log_probs.shape[:2] == (1, 1) and output_log_probs.shape[2] > 0
    assert np.all(output_log_probs <= 0) and np.all(np.isfinite(output_log_probs))
    assert cum_log_probs.shape == (1, 1)
    assert math.isclose(float(cum_log_probs[0, 0]), float(output_log_probs.sum()), rel_tol=1e-3, abs_tol=1e-3)


@pytest.mark.parametrize(
    ("guide_type", "guide", "check"),
    [
        ("json", None, lambda text: json.loads(text) is not None),
        (
            "json_schema",
            '{"properties": {"answer": {"title": "Answer", "type": "integer"}}, "required": ["answer"], '
            '"title": "Answer", "type": "object"}',
            lambda text: isinstance(json.loads(text)["answer"], int),
        ),
        ("regex", r"\d+", lambda text: re.fullmatch(r"\d+", text) is not None),
        ("ebnf_grammar", "root ::= [0-9]+", lambda text: re.fullmatch(r"[0-9]+", text) is not None),
    ],
)
def test_end_to_end_guided_decoding(grpc_url, guide_type, guide, check):
    """NVIDIA's walkthrough (docs/guided_decoding.md): -o 30 --exclude-input-in-output, each guide type."""
    text = completion(
        grpc_url, output_len=30, temperature=0.0, guided_decoding_guide_type=guide_type, guided_decoding_guide=guide
    )
    assert check(text), text


def test_end_to_end_beam_width_two_is_refused_by_name(grpc_url):
    result = run_end_to_end(grpc_url, EndToEnd(PROMPT, output_len=8, beam_width=2))
    assert result.texts == ["", ""]
    (error,) = result.errors
    assert "beam_width" in error.message()


def test_end_to_end_streaming_on_tensorrt_llm_bls(grpc_url):
    """-S --model-name tensorrt_llm_bls: the deltas, appended as the script does, make the text."""
    options = EndToEnd(PROMPT, output_len=24, temperature=0.0, streaming=True, model_name="tensorrt_llm_bls")
    result = run_end_to_end(grpc_url, options)
    assert not result.errors
    assert len(result.responses) > 1 and result.texts[0].strip()
    whole = answer(grpc_url, EndToEnd(PROMPT, output_len=24, temperature=0.0, exclude_input_in_output=True))
    assert result.texts[0] == whole


def test_end_to_end_streaming_on_the_ensemble_is_one_error(grpc_url):
    """-S on `ensemble` in the default deployment: refused, naming how to stream; the script prints the error and
    ends with an empty text (as NVIDIA's decoupled_mode false deployment, where tensorrt_llm refuses streaming)."""
    result = run_end_to_end(grpc_url, EndToEnd(PROMPT, output_len=8, streaming=True))
    assert result.texts == [""] and not result.responses
    (error,) = result.errors
    assert "stream" in error.message() and "--decoupled-mode" in error.message()


def test_end_to_end_return_perf_metrics(grpc_url):
    """--return-perf-metrics: the script reads all ten outputs from each response (as NVIDIA's CI greps them)."""
    for model_name in ("ensemble", "tensorrt_llm_bls"):
        options = EndToEnd(PROMPT, output_len=8, return_perf_metrics=True, model_name=model_name)
        result = run_end_to_end(grpc_url, options)
        assert not result.errors and result.responses
        final = result.responses[-1]
        times = [int(final.as_numpy(name)[0][0]) for name in TIMING_OUTPUTS]
        assert 0 < times[0] <= times[2] <= times[3], times  # arrival <= first token <= last token
        assert [final.as_numpy(n)[0][0] for n in DRAFT_OUTPUTS] == [0, 0, 0]


def test_end_to_end_batch_inputs_are_answered_in_row_order(grpc_url):
    """--batch-inputs on the default ensemble: one response with a row per prompt (NVIDIA's non-decoupled
    tensorrt_llm refuses a batch); the script reads its first row."""
    prompts = [PROMPT, "The capital of France is"]
    alone = [answer(grpc_url, EndToEnd(p, output_len=8, exclude_input_in_output=True)) for p in prompts]
    arrays = end_to_end_inputs(EndToEnd(PROMPT, output_len=8, exclude_input_in_output=True, batch_inputs=prompts))
    with grpcclient.InferenceServerClient(grpc_url) as client:
        result = client.infer("ensemble", [grpc_input(n, a) for n, a in arrays.items()])
    assert [t.decode() for t in result.as_numpy("text_output")] == alone


# ------------------------------------------------------------------ end_to_end_test.py and benchmark_core_model.py


def test_end_to_end_test_steps_by_hand_equal_the_ensemble(grpc_url):
    """end_to_end_test.py: preprocessing, then tensorrt_llm with its DECODER_INPUT_ID (a decoder-only model's
    placeholder), then postprocessing, by hand, give the ensemble's text."""
    words = np.array([[b""]], dtype=object)
    with grpcclient.InferenceServerClient(grpc_url) as client:
        query = {"QUERY": np.array([[PROMPT.encode()]], dtype=object), "REQUEST_OUTPUT_LEN": np.array([[16]], np.int32)}
        query |= {"BAD_WORDS_DICT": words, "STOP_WORDS_DICT": words}
        pre = client.infer("preprocessing", [grpc_input(n, a) for n, a in query.items()])
        engine_inputs = {
            "input_ids": pre.as_numpy("INPUT_ID"),
            "decoder_input_ids": pre.as_numpy("DECODER_INPUT_ID"),
            "input_lengths": pre.as_numpy("REQUEST_INPUT_LEN"),
            "request_output_len": pre.as_numpy("REQUEST_OUTPUT_LEN"),
            "end_id": pre.as_numpy("OUT_END_ID"),
            "pad_id": pre.as_numpy("OUT_PAD_ID"),
        }
        engine = client.infer("tensorrt_llm", [grpc_input(n, a) for n, a in engine_inputs.items()])
        post = {"TOKENS_BATCH": engine.as_numpy("output_ids"), "SEQUENCE_LENGTH": engine.as_numpy("sequence_length")}
        by_hand = client.infer("postprocessing", [grpc_input(n, a) for n, a in post.items()]).as_numpy("OUTPUT")
        ensemble = {"text_input": query["QUERY"], "max_tokens": query["REQUEST_OUTPUT_LEN"]}
        ensemble |= {"bad_words": words, "stop_words": words}
        whole = client.infer("ensemble", [grpc_input(n, a) for n, a in ensemble.items()]).as_numpy("text_output")
    assert by_hand.tolist() == whole.tolist() and whole[0].strip()


def test_benchmark_core_model_batch_over_http(server, tokenizer):
    """benchmark_core_model.py's unary requests (HTTP /infer, a request id) to tensorrt_llm, here two prompts in
    one request: answered in one response, a row each, as they are alone."""
    ids = [tokenizer.encode(PROMPT), tokenizer.encode("The capital of France is")]
    width = max(map(len, ids))
    inputs = {
        "input_ids": np.array([i + [0] * (width - len(i)) for i in ids], np.int32),
        "input_lengths": np.array([[len(i)] for i in ids], np.int32),
        "request_output_len": np.array([[8], [8]], np.int32),
    }
    with httpclient.InferenceServerClient(server.http_url) as client:
        both = client.infer("tensorrt_llm", infer_inputs(inputs), request_id="7")
        alone = [
            client.infer("tensorrt_llm", infer_inputs({k: v[r : r + 1] for k, v in inputs.items()})) for r in (0, 1)
        ]
    rows = both.as_numpy("output_ids")
    lengths = both.as_numpy("sequence_length")
    for row, single in enumerate(alone):
        length = int(single.as_numpy("sequence_length")[0, 0])
        assert int(lengths[row, 0]) == length
        assert rows[row, 0, :length].tolist() == single.as_numpy("output_ids")[0, 0, :length].tolist()


def infer_inputs(arrays: dict[str, np.ndarray]) -> list:
    inputs = []
    for name, array in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


# ------------------------------------------------------------------ inflight_batcher_llm_client.py on our server


def greedy_reference(hf_model, ids: list[int], max_new_tokens: int, end_id: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end_id, pad_token_id=end_id
    )[0, len(ids) :].tolist()
    return out[: out.index(end_id)] if end_id in out else out


@pytest.fixture
def batcher(manifest):
    def make(**options) -> InflightBatcher:
        return InflightBatcher(manifest["tokenizer_dir"], stream_timeout=300, **options)

    return make


def test_inflight_batcher_default_command_line(grpc_url, tokenizer, hf_model, batcher):
    """No -S: one unary call to tensorrt_llm, which the default deployment answers; top_k 1 is greedy, so the
    tokens are transformers' greedy tokens (the engine excludes the prompt: exclude_input_in_output, as NVIDIA's
    quick start renders it)."""
    result = run_inflight_batcher(grpc_url, batcher(), tokenizer)
    (tokens,) = result.output_ids
    assert tokens == greedy_reference(hf_model, result.input_ids, 16, tokenizer.eos_token_id)


def test_inflight_batcher_unary_counts_log_probs_and_perf_metrics(grpc_url, tokenizer, batcher):
    options = batcher(
        exclude_input_in_output=True,
        return_log_probs=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
        return_perf_metrics=True,
    )
    result = run_inflight_batcher(grpc_url, options, tokenizer)
    assert result.texts[0].strip()
    assert int(result.num_input_tokens[0].reshape(-1)[0]) == len(result.input_ids)
    assert int(result.num_output_tokens[0].reshape(-1)[0]) == len(result.output_ids[0])
    assert result.output_log_probs[0].shape[-1] == len(result.output_ids[0]) and np.all(result.output_log_probs[0] <= 0)
    assert set(result.perf_metrics) == set(PERF_OUTPUTS) and result.perf_metrics["arrival_time_ns"] > 0


@pytest.mark.parametrize("options", [{"streaming": True}, {"num_return_sequences": 2}], ids=lambda o: ",".join(o))
def test_inflight_batcher_streams_only_in_the_decoupled_deployment(grpc_url, tokenizer, batcher, options):
    """-S and -n 2 on the default deployment's tensorrt_llm: a 400 naming the option that serves them (NVIDIA's
    decoupled_mode false deployment refuses streaming, and delivers one of n sequences)."""
    with pytest.raises(InferenceServerException, match="--decoupled-mode"):
        run_inflight_batcher(grpc_url, batcher(**options), tokenizer)


def test_the_streaming_request_parameter_is_the_streaming_input(grpc_url, tokenizer):
    """The script sends the Triton request parameter `Streaming` with its requests: taken as the `streaming`
    input, never refused as an unknown input; a contradiction is a 400 naming it."""
    ids = np.array([tokenizer.encode(PROMPT)], np.int32)
    inputs = [grpc_input("input_ids", ids), grpc_input("request_output_len", np.array([[4]], np.int32))]
    inputs.append(grpc_input("input_lengths", np.array([[ids.shape[1]]], np.int32)))
    with grpcclient.InferenceServerClient(grpc_url) as client:
        result = client.infer("tensorrt_llm", inputs, parameters={"Streaming": False})
        assert int(result.as_numpy("sequence_length")[0, 0]) == 4
        with pytest.raises(InferenceServerException, match="Streaming"):
            client.infer(
                "tensorrt_llm", [*inputs, grpc_input("streaming", np.array([[True]]))], parameters={"Streaming": False}
            )
        with pytest.raises(InferenceServerException, match=r"streaming.*--decoupled-mode"):
            client.infer("tensorrt_llm", inputs, parameters={"Streaming": True})


# ------------------------------------------------------------------ NVIDIA's decoupled deployment


@pytest.fixture(scope="module")
def decoupled_url(decoupled_server) -> str:
    return f"{decoupled_server.host}:{decoupled_server.grpc_port}"


def test_decoupled_ensemble_streams_the_greedy_text(decoupled_url, grpc_url):
    """-S on the decoupled ensemble: the deltas, appended as the script does, make the default deployment's text
    (an ASCII answer: postprocessing decodes each response's tokens alone there, as NVIDIA's)."""
    streamed = run_end_to_end(decoupled_url, EndToEnd(PROMPT, output_len=16, streaming=True))
    assert not streamed.errors and len(streamed.responses) > 1
    whole = answer(grpc_url, EndToEnd(PROMPT, output_len=16, exclude_input_in_output=True))
    assert streamed.texts[0] == whole
    assert answer(decoupled_url, EndToEnd(PROMPT, output_len=16, exclude_input_in_output=True)) == whole


def test_decoupled_ensemble_answers_each_sequence_and_row(decoupled_url):
    """-n 2 (sampled: each sequence its own seed) and --batch-inputs: a response per sequence and per row, with
    sequence_index and batch_index, which the script sorts its texts by."""
    options = EndToEnd(PROMPT, output_len=12, num_return_sequences=2, exclude_input_in_output=True)
    sampled = run_end_to_end(decoupled_url, replace(options, temperature=1.0))
    assert not sampled.errors and len(sampled.responses) == 2 and all(sampled.texts)
    indices = sorted(int(r.as_numpy("sequence_index")[0, 0]) for r in sampled.responses)
    assert indices == [0, 1]
    prompts = [PROMPT, "The capital of France is"]
    batch = run_end_to_end(
        decoupled_url, EndToEnd(PROMPT, output_len=8, exclude_input_in_output=True, batch_inputs=prompts)
    )
    assert not batch.errors and len(batch.responses) == 2
    alone = [answer(decoupled_url, EndToEnd(p, output_len=8, exclude_input_in_output=True)) for p in prompts]
    assert batch.texts == alone


def test_decoupled_tensorrt_llm_refuses_unary_calls(decoupled_url, tokenizer, batcher):
    """Without -S the script calls tensorrt_llm unary; Triton refuses that for a decoupled model, as NVIDIA's."""
    with pytest.raises(InferenceServerException, match="decoupled"):
        run_inflight_batcher(decoupled_url, batcher(), tokenizer)


def test_inflight_batcher_streaming_default_request(decoupled_url, tokenizer, hf_model, batcher):
    """-S: top_k 1 is greedy, so the tokens are transformers' greedy tokens; the script prepends the prompt."""
    result = run_inflight_batcher(decoupled_url, batcher(streaming=True), tokenizer)
    (tokens,) = result.output_ids
    generated = tokens[len(result.input_ids) :]
    assert tokens[: len(result.input_ids)] == result.input_ids
    assert generated == greedy_reference(hf_model, result.input_ids, 16, tokenizer.eos_token_id)
    assert result.texts[0] == tokenizer.decode(generated) and result.texts[0].strip()


@pytest.mark.parametrize(
    "options",
    [
        {"beam_width": 1},
        {"exclude_input_in_output": True},
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.8},
        {"frequency_penalty": 0.8},
        {"top_k": 0, "top_p": 0.9, "temperature": 0.7},
    ],
    ids=lambda o: ",".join(o),
)
def test_inflight_batcher_streaming_control_options(decoupled_url, tokenizer, batcher, options):
    result = run_inflight_batcher(decoupled_url, batcher(streaming=True, **options), tokenizer)
    assert result.texts[0].strip()
    if options.get("exclude_input_in_output"):  # the script does not prepend the prompt then
        assert 0 < len(result.output_ids[0]) <= 16


def test_inflight_batcher_streaming_log_probs_and_token_counts(decoupled_url, tokenizer, batcher):
    """Streamed, as TensorRT-LLM: a response's num_output_tokens counts its own tokens."""
    options = batcher(
        streaming=True, return_log_probs=True, return_num_input_tokens=True, return_num_output_tokens=True
    )
    result = run_inflight_batcher(decoupled_url, options, tokenizer)
    assert result.texts[0].strip()
    output_log_probs, cum_log_probs = result.output_log_probs[0], result.cum_log_probs[0]
    assert output_log_probs is not None and output_log_probs.ndim == 2 and np.all(output_log_probs <= 0)
    assert cum_log_probs is not None and cum_log_probs.shape == (1,)
    assert int(result.num_input_tokens[0].reshape(-1)[0]) == len(result.input_ids)
    assert int(result.num_output_tokens[0].reshape(-1)[0]) > 0


def test_inflight_batcher_num_return_sequences(decoupled_url, tokenizer, batcher):
    """-n 2 (with -S or without: the script streams either way): a sequence each, sampled with seeds of their own."""
    result = run_inflight_batcher(decoupled_url, batcher(num_return_sequences=2, top_k=50), tokenizer)
    assert all(tokens for tokens in result.output_ids) and len(result.output_ids) == 2


def test_inflight_batcher_given_ids_with_end_and_pad_ids(decoupled_url, tokenizer, hf_model, batcher):
    """--input-tokens-csv with --end-id/--pad-id: the ids are sent as they are, and the end id stops generation."""
    ids = tokenizer.encode("Born in north-east France, Soyer trained as a")
    eos = tokenizer.eos_token_id
    options = batcher(streaming=True, input_ids=ids, end_id=eos, pad_id=eos)
    result = run_inflight_batcher(decoupled_url, options, tokenizer)
    assert result.output_ids[0][len(ids) :] == greedy_reference(hf_model, ids, 16, eos)


def test_inflight_batcher_beam_width_two_is_refused_by_name(decoupled_url, tokenizer, batcher):
    with pytest.raises(InferenceServerException, match="beam_width"):
        run_inflight_batcher(decoupled_url, batcher(streaming=True, beam_width=2), tokenizer)
