"""The tensorrt_llm model's tensors <-> engine requests."""

import numpy as np
import pytest

from tritonllm.errors import InputError
from tritonllm.link.engine_io import pack_outputs, perf_outputs, sampling_params
from tritonllm.link.engine_io import parse_requests as parse_indexed
from tritonllm.protocol import MAX_WORD_SEQUENCES, PERF_OUTPUTS
from tritonllm.text.wire import Limits, word_list

LIMITS = Limits(max_input_len=8, max_seq_len=16, vocab_size=100)


def parse_requests(given, limits) -> list:
    """The engine requests alone, in order."""
    return [indexed.request for indexed in parse_indexed(given, limits)]


def arrays(ids, output_len=4, **extra):
    ids = np.atleast_2d(np.asarray(ids, dtype=np.int32))
    base = {
        "input_ids": ids,
        "input_lengths": np.full((ids.shape[0],), ids.shape[1], dtype=np.int32),
        "request_output_len": np.full((ids.shape[0],), output_len, dtype=np.int32),
    }
    base.update(extra)
    return base


def test_parse_defaults_are_greedy():
    [req] = parse_requests(arrays([1, 2, 3]), LIMITS)
    assert req.input_ids == [1, 2, 3] and req.max_new_tokens == 4
    assert req.end_id == -1 and not req.sampling.sample and not req.streaming
    assert req.penalties.min_tokens == 1, "TensorRT-LLM's default minimum length: no end id first"
    assert req.penalties.neutral, "min_tokens changes no logits: the engines' greedy paths honour it"


@pytest.mark.parametrize("temperature", [None, 0.5, 2.0])
def test_presence_and_frequency_follow_tensorrt_llms_rule(temperature):
    """TensorRT-LLM counts the prompt and penalises the logits after the temperature: the engine's formula, which
    acts before it, with both penalties scaled by the temperature (a greedy request's too: 1 when absent)."""
    given = {"presence_penalty": np.array([0.8], np.float32), "frequency_penalty": np.array([-0.5], np.float32)}
    if temperature is not None:
        given["temperature"] = np.array([temperature], np.float32)
    [req] = parse_requests(arrays([1, 2], **given), LIMITS)
    scale = 1.0 if temperature is None else temperature
    assert (req.penalties.presence, req.penalties.frequency) == (pytest.approx(0.8 * scale), -0.5 * scale)
    assert req.penalties.count_prompt


def test_openai_penalties_keep_openais_rule():
    given = arrays(
        [1, 2],
        presence_penalty=np.array([0.8], np.float32),
        temperature=np.array([0.5], np.float32),
        openai_penalties=np.array([True]),
    )
    [req] = parse_requests(given, LIMITS)
    assert req.penalties.presence == pytest.approx(0.8) and not req.penalties.count_prompt


def test_num_return_sequences_are_engine_requests_with_their_indices_and_seeds():
    given = arrays([[1, 2], [3, 4]], num_return_sequences=np.array([3, 1], np.int32))
    given.update(runtime_top_p=np.array([0.9, 0.9], np.float32), seed=np.array([7, 7], np.uint64))
    indexed = parse_indexed(given, LIMITS)
    assert [(i.batch_index, i.sequence_index) for i in indexed] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert [i.request.sampling.seed for i in indexed] == [7, 8, 9, 7]
    assert [i.request.input_ids for i in indexed] == [[1, 2]] * 3 + [[3, 4]]
    with pytest.raises(InputError, match="num_return_sequences"):
        parse_indexed(arrays([1, 2], num_return_sequences=np.array([0], np.int32)), LIMITS)


def test_parse_batch_with_lengths_and_words():
    stop = np.stack([word_list([(5,), (6, 7)]), np.pad(word_list([(9,)]), ((0, 0), (0, 2)), constant_values=-1)])
    reqs = parse_requests(
        arrays(
            [[1, 2, 3], [4, 5, 0]],
            input_lengths=np.array([3, 2], np.int32),
            end_id=np.array([2, 2], np.int32),
            stop_words_list=stop,
        ),
        LIMITS,
    )
    assert [r.input_ids for r in reqs] == [[1, 2, 3], [4, 5]]
    assert reqs[0].stop_words == ((5,), (6, 7)) and reqs[1].stop_words == ((9,),)
    assert all(r.end_id == 2 for r in reqs)


@pytest.mark.parametrize(
    ("given", "field"),
    [
        (arrays(list(range(9))), "input_ids"),  # over max_input_len 8
        (arrays([1, 2], output_len=0), "request_output_len"),
        (arrays([1, 2], output_len=15), "request_output_len"),  # 2 + 15 > 16
        (arrays([1, 200]), "input_ids"),  # outside the vocabulary
        (arrays([1, 2], input_lengths=np.array([5], np.int32)), "input_lengths"),
        (arrays([1, 2], temperature=np.array([-1.0], np.float32)), "temperature"),
        (arrays([1, 2], bad_words_list=word_list([(i,) for i in range(MAX_WORD_SEQUENCES + 1)])), "bad_words_list"),
        (arrays([1, 2], bad_words_list=word_list([(5, 100)])), "bad_words_list"),  # outside the vocabulary
        (arrays([1, 2], stop_words_list=word_list([(-3,)])), "stop_words_list"),
        ({}, "input_ids"),
    ],
)
def test_parse_errors(given, field):
    with pytest.raises(InputError) as err:
        parse_requests(given, LIMITS)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "sample"),
    [
        (None, None, None, False),
        (0.0, None, None, False),
        (0.7, None, None, False),  # a temperature alone is greedy, as in TensorRT-LLM (top_k 0, top_p 0)
        (0.7, None, 1.0, True),  # top_p 1: the whole distribution, at that temperature
        (0.7, None, 0.0, False),  # runtime_top_p 0 is unset
        (0.7, 1, None, False),  # top_k 1 is greedy whatever the temperature
        (0.0, 40, None, False),  # temperature 0 is greedy whatever the cut
        (None, 40, None, True),
        (None, None, 0.9, True),
        (None, None, 1.0, True),
        (None, 0, None, False),
    ],
)
def test_sampling_switch(temperature, top_k, top_p, sample):
    params = sampling_params(temperature, top_k, top_p, 123)
    assert params.sample is sample
    if sample:
        assert params.seed == 123 and params.temperature > 0


def test_unseeded_sampling_gets_a_random_seed():
    assert sampling_params(0.5, None, 1.0, None).seed != sampling_params(0.5, None, 1.0, None).seed


def test_pack_outputs_pads_and_counts():
    out = pack_outputs([[1, 2, 3], [4]], pad_id=0)
    assert out["output_ids"].shape == (2, 1, 3) and out["output_ids"].dtype == np.int32
    assert out["output_ids"][1, 0].tolist() == [4, 0, 0]
    assert out["sequence_length"].tolist() == [[3], [1]]
    assert pack_outputs([[]], 0)["output_ids"].shape == (1, 1, 1)


def test_parse_controls():
    bias = np.zeros((1, 100), np.float32)
    bias[0, 7], bias[0, 9] = 2.5, -np.inf
    [req] = parse_requests(
        arrays(
            [1, 2],
            repetition_penalty=np.array([1.3], np.float32),
            presence_penalty=np.array([0.5], np.float32),
            frequency_penalty=np.array([-0.25], np.float32),
            min_tokens=np.array([3], np.int32),
            beam_width=np.array([1], np.int32),
            len_penalty=np.array([0.7], np.float32),
            embedding_bias=bias,
            num_top_log_probs=np.array([4], np.int32),
            guided_decoding_guide_type=np.array([[b"regex"]], dtype=object),
            guided_decoding_guide=np.array([[b"[0-9]+"]], dtype=object),
        ),
        LIMITS,
    )
    assert (req.penalties.repetition, req.penalties.presence, req.penalties.frequency) == (
        pytest.approx(1.3),
        0.5,
        -0.25,
    )
    assert req.penalties.min_tokens == 3 and req.penalties.count_prompt
    assert req.embedding_bias == ((7, 2.5), (9, -np.inf))
    assert req.log_probs == 4 and (req.guide.type, req.guide.text) == ("regex", "[0-9]+")


def test_parse_neutral_controls_by_default():
    [req] = parse_requests(arrays([1, 2], return_log_probs=np.array([True])), LIMITS)
    assert req.penalties.neutral and req.embedding_bias == () and req.guide is None and req.log_probs == 0
    [req] = parse_requests(arrays([1, 2], embedding_bias=np.zeros((1, 0), np.float32)), LIMITS)
    assert req.embedding_bias == () and req.log_probs == -1


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"beam_width": np.array([2], np.int32)}, "beam_width"),
        ({"repetition_penalty": np.array([0.0], np.float32)}, "repetition_penalty"),
        ({"presence_penalty": np.array([np.nan], np.float32)}, "presence_penalty"),
        ({"frequency_penalty": np.array([np.inf], np.float32)}, "frequency_penalty"),
        ({"min_tokens": np.array([-1], np.int32)}, "min_tokens"),
        ({"embedding_bias": np.zeros((1, 99), np.float32)}, "embedding_bias"),
        ({"embedding_bias": np.full((1, 100), np.nan, np.float32)}, "embedding_bias"),
        ({"num_top_log_probs": np.array([21], np.int32)}, "num_top_log_probs"),
        ({"num_top_log_probs": np.array([-1], np.int32)}, "num_top_log_probs"),
        (
            {"presence_penalty": np.array([np.inf], np.float32), "temperature": np.array([0.0], np.float32)},
            "presence_penalty",
        ),
        ({"embedding_bias": np.full((1, 100), np.inf, np.float32)}, "embedding_bias"),
        ({"guided_decoding_guide_type": np.array([[b"xml"]], dtype=object)}, "guided_decoding_guide_type"),
        ({"guided_decoding_guide_type": np.array([[b"regex"]], dtype=object)}, "guided_decoding_guide"),
        ({"guided_decoding_guide": np.array([[b"{}"]], dtype=object)}, "guided_decoding_guide_type"),
    ],
)
def test_parse_control_errors_name_the_input(extra, field):
    with pytest.raises(InputError) as err:
        parse_requests(arrays([1, 2], **extra), LIMITS)
    assert err.value.field == field
    assert "nan" not in str(err.value) or "nan" in str(extra), "checked as sent, before any scaling"


def test_pack_outputs_with_log_probs():
    from tritonllm.engine.api import TokenLogProbs

    rows = [[TokenLogProbs(-0.5, ((3, -0.5), (4, -1.5))), TokenLogProbs(-2.0, ((5, -0.1), (6, -2.0)))], []]
    out = pack_outputs([[3, 6], [9]], pad_id=0, log_probs=rows, top=2)
    assert out["output_log_probs"].shape == (2, 1, 2) and out["output_log_probs"][0, 0].tolist() == [-0.5, -2.0]
    assert out["cum_log_probs"][:, 0].tolist() == [-2.5, 0.0]
    assert out["top_log_prob_ids"][0, 0].tolist() == [[3, 4], [5, 6]]
    assert out["top_log_probs"].shape == (2, 1, 2, 2)
    assert "top_log_probs" not in pack_outputs([[3]], pad_id=0, log_probs=[rows[0][:1]], top=0)


def test_runtime_top_p_of_zero_is_unset_as_in_tensorrt_llm():
    assert sampling_params(None, None, 0.0, None) == sampling_params(None, None, None, None)


def test_perf_outputs_are_the_requested_ones_or_all():
    """A streamed response carries them on every token: the engine model builds only those the request asked for."""
    every = perf_outputs(10, 3, 4, 1.0, None)
    assert list(every) == list(PERF_OUTPUTS)
    asked = perf_outputs(10, 3, 4, 1.0, None, {"output_ids", "kv_cache_reused_blocks"})
    assert list(asked) == ["kv_cache_reused_blocks"] and asked["kv_cache_reused_blocks"][0, 0] == 4
    assert perf_outputs(10, 3, 4, 1.0, None, {"output_ids"}) == {}
