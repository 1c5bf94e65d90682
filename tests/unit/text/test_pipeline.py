"""The per-request pipeline (tritonllm/text/pipeline.py), loaded from the built repository, fed engine outputs by
hand."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import BUILD
from tritonllm.errors import InputError
from tritonllm.text.pipeline import Parts, StreamedRequest

TEXT = "Hello, world! The capital of France is Paris. 中国的首都是北京"


@pytest.fixture(scope="module")
def parts():
    return Parts.load(BUILD / "model_repository", "ensemble", skip_special_tokens=True)


def make(parts, prompt="Say something.", max_tokens=64, **inputs) -> StreamedRequest:
    arrays = {
        "text_input": np.array([[prompt.encode()]], dtype=object),
        "max_tokens": np.array([[max_tokens]], dtype=np.int32),
    }
    for name, value in inputs.items():
        arrays[name] = np.array([value], dtype=object if isinstance(value[0], bytes) else None)
    return parts.request(arrays)


def response(ids: list[int], log_probs: list[float] | None = None) -> dict[str, np.ndarray]:
    outputs = {"output_ids": np.array([[ids]], dtype=np.int32), "sequence_length": np.array([[len(ids)]])}
    if log_probs is not None:
        outputs["output_log_probs"] = np.array([[log_probs]], dtype=np.float32)
    return outputs


def test_streamed_deltas_and_the_final_text_are_the_whole_text(parts, tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    request = make(parts, max_tokens=len(ids), stream=[True])
    deltas = [request.push(response([token])) for token in ids]
    final = request.final()
    streamed = "".join(d.text for d in deltas if d is not None) + final["text_output"][0].decode()
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
    assert any(d is None for d in deltas), "a token that ends inside a character sends nothing yet"
    assert final["finish_reason"][0] == b"length"


def test_a_stop_string_ends_the_text_before_it(parts, tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    request = make(parts, stream=[True], stop_words=[b"France"])
    text = ""
    for token in ids:
        delta = request.push(response([token]))
        text += delta.text if delta else ""
        if request.stopped:
            break
    text += request.final()["text_output"][0].decode()
    assert text == TEXT[: TEXT.index("France")]
    assert request.final()["finish_reason"][0] == b"stop"


def test_a_whole_answer_comes_once_with_its_prompt_when_asked(parts, tokenizer):
    ids = tokenizer(" Paris.", add_special_tokens=False)["input_ids"]
    request = make(
        parts, prompt="The capital of France is", exclude_input_in_output=[False], return_num_output_tokens=[True]
    )
    assert request.push(response(ids)) is None, "not streaming: nothing until the end"
    final = request.final()
    assert final["text_output"][0].decode() == "The capital of France is Paris."
    assert final["num_output_tokens"].tolist() == [[len(ids)]]
    assert final["finish_reason"][0] == b"eos", "it ended before max_tokens without a stop string"


@pytest.mark.parametrize("cumulative", [True, False])
def test_log_probs_are_each_responses_own_whatever_the_engine_repeats(parts, cumulative):
    """TensorRT-LLM's streamed log probs are all those so far; the portable engine's, the response's own."""
    request = make(parts, stream=[True], return_log_probs=[True])
    first = request.push(response([11], [-0.5]))
    second = request.push(response([12], [-0.5, -0.25] if cumulative else [-0.25]))
    assert (first.ids, first.log_probs, second.ids, second.log_probs) == ([11], [-0.5], [12], [-0.25])
    assert request.final()["cum_log_probs"].tolist() == [[-0.75]]
    assert request.delta_tensors(second)["output_log_probs"].shape == (1, 1, 1)


def test_the_engine_request_streams_and_carries_preprocessings_outputs(parts, tokenizer):
    request = make(parts, prompt="Hi", max_tokens=5, stream=[False])
    inputs = request.engine_inputs()
    assert inputs["streaming"].tolist() == [[True]], "the engine always streams to the pipeline"
    assert inputs["input_ids"].reshape(-1).tolist() == tokenizer("Hi")["input_ids"]
    assert inputs["request_output_len"].tolist() == [[5]]
    assert request.engine_outputs() == ["output_ids", "sequence_length"]
    assert make(parts, num_top_log_probs=[np.int32(2)]).engine_outputs()[2:] == [
        "output_log_probs",
        "top_log_probs",
        "top_log_prob_ids",
    ]


@pytest.mark.parametrize(("name", "value"), [("beam_width", 2), ("num_return_sequences", 2)])
def test_what_one_stream_cannot_carry_is_refused_by_name(parts, name, value):
    with pytest.raises(InputError) as error:
        make(parts, **{name: [np.int32(value)]})
    assert error.value.field == name
