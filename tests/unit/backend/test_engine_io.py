"""The tensorrt_llm model's tensors <-> engine requests."""

import numpy as np
import pytest

from tritonllm.backend.engine_io import pack_outputs, parse_requests, sampling_params
from tritonllm.errors import InputError
from tritonllm.protocol import MAX_WORD_SEQUENCES
from tritonllm.text.tokenization import Limits, word_list

LIMITS = Limits(max_input_len=8, max_seq_len=16, vocab_size=100)


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
        (arrays([[1, 2], [3, 4]], streaming=np.array([True, True])), "streaming"),
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
        (0.7, None, None, True),
        (0.7, 1, None, False),  # top_k 1 is greedy whatever the temperature
        (None, 40, None, True),
        (None, None, 0.9, True),
        (None, None, 1.0, False),
        (None, 0, None, False),
    ],
)
def test_sampling_switch(temperature, top_k, top_p, sample):
    params = sampling_params(temperature, top_k, top_p, 123)
    assert params.sample is sample
    if sample:
        assert params.seed == 123 and params.temperature > 0


def test_unseeded_sampling_gets_a_random_seed():
    assert sampling_params(0.5, None, None, None).seed != sampling_params(0.5, None, None, None).seed


def test_pack_outputs_pads_and_counts():
    out = pack_outputs([[1, 2, 3], [4]], pad_id=0)
    assert out["output_ids"].shape == (2, 1, 3) and out["output_ids"].dtype == np.int32
    assert out["output_ids"][1, 0].tolist() == [4, 0, 0]
    assert out["sequence_length"].tolist() == [[3], [1]]
    assert pack_outputs([[]], 0)["output_ids"].shape == (1, 1, 1)
