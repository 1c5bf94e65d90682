"""Unit: request bodies, their checks (a 400 naming the parameter), and the tensors each parameter becomes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from tritonllm.openai.chat_models import ChatRequest
from tritonllm.openai.models import NO_OPS, UNSUPPORTED, APIError, CompletionRequest
from tritonllm.protocol import SCALAR_INPUTS, request_tensors

VOCAB = 1000
MESSAGES = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> ChatRequest:
    return ChatRequest(**{"model": "m", "messages": MESSAGES, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="Hi", **fields)


def refused(request, param: str, engine_additions: bool = True) -> APIError:
    with pytest.raises(APIError) as err:
        request.check_supported(VOCAB, engine_additions)
    assert (err.value.status, err.value.param) == (400, param)
    assert param.split(".")[0].split("[")[0] in str(err.value)
    return err.value


def test_defaults_send_only_what_usage_and_streaming_need():
    inputs = chat().inputs(0, VOCAB)
    assert {k: v for k, v in inputs.items() if v not in (None, [], {})} == {
        "chat": False,
        "min_tokens": 0,  # stated, against NVIDIA's interface's default of 1
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_perf_metrics": True,
        "stream": True,
    }
    names = [name for name, _, _ in request_tensors("Hi", 4, **inputs)]
    assert names == [
        "text_input",
        "max_tokens",
        "apply_chat_template",
        "min_tokens",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "return_perf_metrics",
        "stream",
    ]


def test_a_temperature_alone_samples_the_whole_distribution():
    """OpenAI samples at any temperature above 0; NVIDIA's interface below decodes a temperature alone greedily,
    as TensorRT-LLM, so the layer states top_p 1.0 then, and nothing when top_p or top_k is given or it is greedy."""
    assert chat(temperature=0.7).inputs(0, VOCAB)["top_p"] == 1.0
    assert chat(temperature=0.7, top_p=0.5).inputs(0, VOCAB)["top_p"] == 0.5
    assert chat(temperature=0.7, top_k=40).inputs(0, VOCAB)["top_p"] is None
    assert chat(temperature=0.0).inputs(0, VOCAB)["top_p"] is None
    assert chat().inputs(0, VOCAB)["top_p"] is None


def test_every_control_becomes_its_tensor():
    body = chat(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        min_tokens=3,
        ignore_eos=True,
        logit_bias={"7": -100, "12": 5.5},
        stop=["x"],
        bad_words=["y"],
        logprobs=True,
        top_logprobs=4,
        response_format={"type": "json_object"},
    )
    body.check_supported(VOCAB)
    tensors = {name: (value, datatype) for name, value, datatype in request_tensors("Hi", 8, **body.inputs(2, VOCAB))}
    for name, value in {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 13,  # seed + choice
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "min_tokens": 3,
        "end_id": -1,
        "return_log_probs": True,
        "num_top_log_probs": 4,
        "guided_decoding_guide_type": b"json",
    }.items():
        array, datatype = tensors[name]
        assert array.shape == (1, 1) and datatype == SCALAR_INPUTS[name][1], name
        assert array.reshape(-1)[0] == pytest.approx(value) if datatype == "FP32" else array[0, 0] == value, name
    assert "guided_decoding_guide" not in tensors  # "json": any JSON, no guide
    assert tensors["logit_bias_token_ids"][0].tolist() == [[7, 12]]
    assert tensors["logit_bias_weights"][0].tolist() == [[-100.0, 5.5]]
    assert tensors["stop_words"][0].tolist() == [[b"x"]] and tensors["bad_words"][0].tolist() == [[b"y"]]


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_off_is_not_sent(top_k):
    assert chat(top_k=top_k).inputs(0, VOCAB)["top_k"] is None


def test_neutral_penalties_are_not_sent():
    inputs = chat(presence_penalty=0, frequency_penalty=0.0).inputs(0, VOCAB)
    assert inputs["presence_penalty"] is None and inputs["frequency_penalty"] is None
    assert inputs["openai_penalties"] is None


def test_penalties_ask_for_openais_rule_where_the_engine_takes_it():
    assert chat(presence_penalty=0.5).inputs(0, VOCAB)["openai_penalties"] is True
    assert chat(frequency_penalty=0.5).inputs(0, VOCAB, engine_additions=False)["openai_penalties"] is None


def test_logprobs_without_top_logprobs_asks_for_the_chosen_tokens_only():
    inputs = chat(logprobs=True).inputs(0, VOCAB)
    assert inputs["return_log_probs"] is True and inputs["num_top_log_probs"] is None
    inputs = completion(logprobs=3).inputs(0, VOCAB)
    assert inputs["return_log_probs"] is True and inputs["num_top_log_probs"] == 3
    assert completion(logprobs=0).inputs(0, VOCAB)["return_log_probs"] is True


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1e39}, "repetition_penalty"),  # past FP32: infinity in the tensor
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"temperature": 2.5}, "temperature"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
    ],
)
def test_out_of_range_is_refused_by_the_body(fields, param):
    with pytest.raises(ValidationError) as err:
        chat(**fields)
    assert err.value.errors()[0]["loc"][0] == param


@pytest.mark.parametrize("logprobs", [-1, 6])
def test_completion_logprobs_range_is_openais(logprobs):
    with pytest.raises(ValidationError):
        completion(logprobs=logprobs)


@pytest.mark.parametrize(
    ("bias", "why"),
    [
        ({"1000": 1}, "not in the vocabulary"),
        ({"-1": 1}, "not in the vocabulary"),
        ({"five": 1}, "token ids"),
        ({"5": 101}, "-100..100"),
        ({str(i): 1 for i in range(301)}, "at most"),
    ],
)
def test_logit_bias_is_checked_here(bias, why):
    assert why in str(refused(chat(logit_bias=bias), "logit_bias"))


def test_echo_with_logprobs_is_refused_naming_echo():
    error = refused(completion(echo=True, logprobs=0), "echo")
    assert "logprobs" in str(error)
    completion(echo=True).check_supported(VOCAB)


def test_top_logprobs_needs_logprobs():
    refused(chat(top_logprobs=2), "top_logprobs")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"guided_json": "not json"}, "guided_json"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"bad_words": ["z" * 300]}, "bad_words"),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(fields, param):
    refused(chat(**fields), param)


def test_stream_options_needs_stream():
    """OpenAI's rule, one for both bodies: `stream_options` only with `stream: true` (null stays accepted)."""
    for request in (chat, completion):
        error = refused(request(stream_options={"include_usage": True}), "stream_options")
        assert "'stream' is enabled" in str(error)
        refused(request(stream=False, stream_options={}), "stream_options")
        request(stream=True, stream_options={"include_usage": True}).check_supported(VOCAB)
        request(stream_options=None).check_supported(VOCAB)


def test_best_of_and_suffix():
    completion(best_of=2, n=2).check_supported(VOCAB)
    refused(completion(best_of=3), "best_of")
    refused(completion(suffix="end"), "suffix")


def test_unknown_parameters_are_refused_and_no_ops_accepted():
    with pytest.raises(ValidationError) as err:
        chat(frobnicate=1)
    assert err.value.errors()[0]["type"] == "extra_forbidden"
    accepted = {
        "user": "u",
        "metadata": {"a": "b"},
        "store": False,
        "service_tier": "auto",
        "safety_identifier": "s",
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
    }
    assert set(accepted) == set(NO_OPS)
    chat(**accepted, parallel_tool_calls=True, stream_options={"include_usage": True, "include_obfuscation": False})
    for name, neutral in UNSUPPORTED.items():  # their neutral values pass
        if name in ChatRequest.model_fields:
            chat(**{name: neutral[-1]}).check_supported(VOCAB)


def test_messages_keep_tool_calls_and_ignore_what_an_answer_carries_besides():
    body = chat(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "annotations": [],
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    rendered = [m.rendered() for m in body.messages]
    assert rendered[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}],
    }
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_a_user_message_needs_content():
    with pytest.raises(APIError) as err:
        chat(messages=[{"role": "user", "content": None}]).messages[0].text()
    assert err.value.param == "messages"


def test_guides():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
    assert body.guide() == ("json_schema", json.dumps(schema))
    assert chat(response_format={"type": "text"}).guide() is None
    assert chat(guided_regex="[0-9]+").guide() == ("regex", "[0-9]+")
    assert chat(guided_grammar='root ::= "a"').guide() == ("ebnf_grammar", 'root ::= "a"')
    assert chat(guided_json=json.dumps(schema)).guide() == ("json_schema", json.dumps(schema))
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": schema}},
        {"type": "function", "function": {"name": "g"}},
    ]
    named = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.tool_mode() == "named" and named.guide() == ("json_schema", json.dumps(schema))
    required = chat(tools=tools, tool_choice="required")
    kind, text = required.guide()
    assert kind == "json_schema" and [a["properties"]["name"] for a in json.loads(text)["anyOf"]] == [
        {"const": "f"},
        {"const": "g"},
    ]
    assert chat(tools=tools).tool_mode() == "auto" and chat(tools=tools).guide() is None
    none = chat(tools=tools, tool_choice="none")
    assert none.tool_mode() == "none" and none.offered_tools() == []
    assert chat(tools=tools).offered_tools()[1] == {"type": "function", "function": {"name": "g"}}


def test_tensor_dtypes_match_the_contract():
    tensors = request_tensors("Hi", 4, **chat(seed=2**64 - 1, top_k=3).inputs(1, VOCAB))
    seed = next(value for name, value, _ in tensors if name == "seed")
    assert seed.dtype == np.uint64 and seed[0, 0] == 0  # seed + choice wraps around


def test_top_log_probs_are_refused_by_name_where_the_engine_has_none():
    """The TensorRT-LLM flavor returns the chosen tokens' log probs only: more is a 400 naming OpenAI's parameter."""
    refused(chat(logprobs=True, top_logprobs=3), "top_logprobs", engine_additions=False)
    refused(completion(logprobs=2), "logprobs", engine_additions=False)
    chat(logprobs=True, top_logprobs=0).check_supported(VOCAB, engine_additions=False)
    completion(logprobs=0).check_supported(VOCAB, engine_additions=False)
    chat(logprobs=True, top_logprobs=3).check_supported(VOCAB)
