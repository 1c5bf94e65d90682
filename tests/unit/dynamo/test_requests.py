"""Dynamo's requests taken by the OpenAI layer's rules: each control honoured, left to Dynamo, or refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from tritonllm.dynamo.requests import chunk, completion_request, engine_arrays, final_chunk
from tritonllm.openai.models import APIError
from tritonllm.text.pipeline import Delta

VOCAB = 49152


def arrays(request: dict, room: int = 100) -> dict[str, np.ndarray]:
    body = completion_request(request, room, VOCAB)
    return engine_arrays(body, VOCAB)


def value(tensors: dict[str, np.ndarray], name: str):
    return tensors[name].reshape(-1)[0]


def test_controls_become_the_engine_requests_inputs():
    tensors = arrays(
        {
            "token_ids": [1, 2, 3],
            "sampling_options": {"temperature": 0.7, "top_k": 5, "seed": 11, "presence_penalty": 0.5, "n": 1},
            "stop_conditions": {"max_tokens": 9, "min_tokens": 2, "ignore_eos": True, "stop": ["."]},
            "output_options": {"logprobs": 3, "skip_special_tokens": True},
        }
    )
    assert "text_input" not in tensors  # the prompt comes in tokens
    assert value(tensors, "max_tokens") == 9 and value(tensors, "min_tokens") == 2
    assert value(tensors, "temperature") == np.float32(0.7) and value(tensors, "top_k") == 5
    assert value(tensors, "seed") == 11 and value(tensors, "end_id") == -1
    assert value(tensors, "presence_penalty") == np.float32(0.5) and value(tensors, "openai_penalties")
    assert value(tensors, "num_top_log_probs") == 3 and value(tensors, "return_log_probs")
    assert "stop_words" not in tensors  # Dynamo's frontend ends the request at a stop string itself


def test_max_tokens_defaults_to_the_room_the_prompt_leaves():
    assert value(arrays({"token_ids": [1]}, room=4000), "max_tokens") == 4000


def test_a_guide_is_the_openai_layers():
    tensors = arrays({"sampling_options": {"guided_decoding": {"json": {"type": "object"}, "backend": "xgrammar"}}})
    assert value(tensors, "guided_decoding_guide_type") == b"json_schema"
    assert value(tensors, "guided_decoding_guide") == b'{"type": "object"}'


@pytest.mark.parametrize(
    "request_, name",
    [
        ({"sampling_options": {"n": 2}}, "sampling_options.n"),
        ({"sampling_options": {"min_p": 0.1}}, "sampling_options.min_p"),
        ({"sampling_options": {"use_beam_search": True}}, "sampling_options.use_beam_search"),
        ({"sampling_options": {"temperature": 5.0}}, "sampling_options.temperature"),
        ({"sampling_options": {"repetition_penalty": 0.0}}, "sampling_options.repetition_penalty"),
        ({"sampling_options": {"something_new": 1}}, "sampling_options.something_new"),
        ({"sampling_options": {"guided_decoding": {"choice": ["a", "b"]}}}, "sampling_options.guided_decoding.choice"),
        ({"sampling_options": {"guided_decoding": {"regex": "a", "backend": "outlines"}}}, "guided_decoding.backend"),
        ({"sampling_options": {"guided_decoding": {"regex": "a", "json": {}}}}, "guided_decoding.regex"),
        ({"stop_conditions": {"max_tokens": 0}}, "stop_conditions.max_tokens"),
        ({"stop_conditions": {"max_thinking_tokens": 8}}, "stop_conditions.max_thinking_tokens"),
        ({"output_options": {"prompt_logprobs": 1}}, "output_options.prompt_logprobs"),
        ({"output_options": {"logprobs": 100}}, "output_options.logprobs"),
        ({"stop_conditions": "no"}, "stop_conditions"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_its_dynamo_name(request_, name):
    with pytest.raises(APIError) as refused:
        completion_request({"token_ids": [1], **request_}, 100, VOCAB)
    assert refused.value.status == 400
    assert name in str(refused.value)


def test_deltas_and_the_final_response_become_dynamos_chunks():
    delta = Delta(text="hi", ids=[5, 6], log_probs=[-0.1, -0.2])
    delta.top_ids = [np.array([5, 7]), np.array([6, 8])]
    delta.top_log_probs = [np.array([-0.1, -2.0]), np.array([-0.2, -3.0])]
    out = chunk(delta, lambda token: f"<{token}>")
    assert out["token_ids"] == [5, 6] and out["index"] == 0 and out["log_probs"] == [-0.1, -0.2]
    assert out["top_logprobs"][1] == [
        {"rank": 1, "token_id": 6, "token": "<6>", "logprob": pytest.approx(-0.2)},
        {"rank": 2, "token_id": 8, "token": "<8>", "logprob": pytest.approx(-3.0)},
    ]
    final = {
        "finish_reason": np.array([b"eos"], dtype=object),
        "num_input_tokens": np.array([[40]], np.int32),
        "num_output_tokens": np.array([[3]], np.int32),
        "kv_cache_reused_blocks": np.array([[39]], np.int64),
    }
    last = final_chunk(final, block_tokens=1)
    assert last["finish_reason"] == "stop" and last["token_ids"] == []
    assert last["completion_usage"] == {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "total_tokens": 43,
        "prompt_tokens_details": {"cached_tokens": 39},
    }
