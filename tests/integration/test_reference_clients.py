"""Integration: NVIDIA's own client scripts' requests (tests/integration/reference_clients.py) against our server.

end_to_end_grpc_client.py: its default command line (ensemble, not streaming) and each control option
answer without an error and with sensible text. Its streaming mode `-S` is tested on
`tensorrt_llm_bls`, where it streams; on `ensemble` (the script's default model) our server refuses
`stream=true` by design: the script then receives one error response, prints "Received an error from
server" with our message, ends with an empty text and exits 0 (it raises on no error response).

inflight_batcher_llm_client.py: without `-S` (and without `-n`) the script makes one unary call, which
Triton refuses for a decoupled model, ours as NVIDIA's (decoupled_mode true); it then exits with
"Encountered error". With `-S` it uses a gRPC stream, which our decoupled tensorrt_llm answers: that
request and its control options are checked here. `-n` sends num_return_sequences, which this server
refuses by name.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from tests.integration.reference_clients import (
    EndToEnd,
    InflightBatcher,
    end_to_end_inputs,
    end_to_end_outputs,
    inflight_batcher_inputs,
    run_end_to_end,
    run_inflight_batcher,
)

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
    """The script sends exclude_input_in_output=false: the text is the prompt, then the completion.

    Its default temperature 1.0 samples here (the completion may be empty: the model may end at once);
    TensorRT-LLM's sampler is greedy when neither top_k nor top_p is given and never ends before one token.
    """
    text = answer(grpc_url, EndToEnd(PROMPT, output_len=24, model_name=model_name))
    assert text.startswith(PROMPT)


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
    """-S on `ensemble`: refused by design; the script prints the error and ends with an empty text."""
    result = run_end_to_end(grpc_url, EndToEnd(PROMPT, output_len=8, streaming=True))
    assert result.texts == [""] and not result.responses
    (error,) = result.errors
    assert "stream" in error.message()


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


def test_inflight_batcher_default_command_line_is_refused_as_unary(grpc_url, tokenizer, batcher):
    """Without -S the script calls tensorrt_llm unary; Triton refuses that for a decoupled model."""
    with pytest.raises(InferenceServerException, match="decoupled"):
        run_inflight_batcher(grpc_url, batcher(), tokenizer)


def test_inflight_batcher_streaming_default_request(grpc_url, tokenizer, hf_model, batcher):
    """-S: top_k 1 is greedy, so the tokens are transformers' greedy tokens; the script prepends the prompt."""
    result = run_inflight_batcher(grpc_url, batcher(streaming=True), tokenizer)
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
def test_inflight_batcher_streaming_control_options(grpc_url, tokenizer, batcher, options):
    result = run_inflight_batcher(grpc_url, batcher(streaming=True, **options), tokenizer)
    assert result.texts[0].strip()
    if options.get("exclude_input_in_output"):  # the script does not prepend the prompt then
        assert 0 < len(result.output_ids[0]) <= 16


def test_inflight_batcher_streaming_log_probs_and_token_counts(grpc_url, tokenizer, batcher):
    options = batcher(
        streaming=True, return_log_probs=True, return_num_input_tokens=True, return_num_output_tokens=True
    )
    result = run_inflight_batcher(grpc_url, options, tokenizer)
    assert result.texts[0].strip()
    output_log_probs, cum_log_probs = result.output_log_probs[0], result.cum_log_probs[0]
    assert output_log_probs is not None and output_log_probs.ndim == 2 and np.all(output_log_probs <= 0)
    assert cum_log_probs is not None and cum_log_probs.shape == (1,)
    assert int(result.num_input_tokens[0].reshape(-1)[0]) == len(result.input_ids)
    assert int(result.num_output_tokens[0].reshape(-1)[0]) > 0


def test_inflight_batcher_given_ids_with_end_and_pad_ids(grpc_url, tokenizer, hf_model, batcher):
    """--input-tokens-csv with --end-id/--pad-id: the ids are sent as they are, and the end id stops generation."""
    ids = tokenizer.encode("Born in north-east France, Soyer trained as a")
    eos = tokenizer.eos_token_id
    result = run_inflight_batcher(grpc_url, batcher(streaming=True, input_ids=ids, end_id=eos, pad_id=eos), tokenizer)
    assert result.output_ids[0][len(ids) :] == greedy_reference(hf_model, ids, 16, eos)


def test_inflight_batcher_beam_width_two_is_refused_by_name(grpc_url, tokenizer, batcher):
    with pytest.raises(InferenceServerException, match="beam_width"):
        run_inflight_batcher(grpc_url, batcher(streaming=True, beam_width=2), tokenizer)
