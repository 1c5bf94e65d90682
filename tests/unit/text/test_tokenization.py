"""Preprocessing: prompts to engine inputs, and every limit refused with a message naming the input."""

import numpy as np
import pytest

from tritonllm.errors import InputError
from tritonllm.protocol import MAX_WORDS
from tritonllm.text.tokenization import GUIDES_COMPILED, GUIDES_OFF, Preprocessor
from tritonllm.text.wire import Limits, parse_word_list, word_list

LIMITS = Limits(max_input_len=64, max_seq_len=96, vocab_size=49152)


@pytest.fixture(scope="module")
def pre(tokenizer):
    return Preprocessor(tokenizer, LIMITS)


def request(*texts, max_tokens=8, **extra):
    arrays = {
        "QUERY": np.array([[t if isinstance(t, bytes) else t.encode()] for t in texts], dtype=object),
        "REQUEST_OUTPUT_LEN": np.full((len(texts), 1), max_tokens, dtype=np.int32),
    }
    arrays.update(extra)
    return arrays


def test_outputs_match_the_tokenizer(pre, tokenizer):
    [out] = pre.process([request("Hello world", "中国的首都是")])
    for row, text in enumerate(["Hello world", "中国的首都是"]):
        ids = tokenizer(text)["input_ids"]
        assert out["REQUEST_INPUT_LEN"][row, 0] == len(ids)
        assert out["INPUT_ID"][row, : len(ids)].tolist() == ids
    assert out["INPUT_ID"].dtype == np.int32
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[8], [8]]
    assert out["OUT_END_ID"].tolist() == [[tokenizer.eos_token_id]] * 2
    assert out["STOP_WORDS_IDS"].shape[:2] == (2, 2)


class CountingTokenizer:
    """The tokenizer, recording the texts of each call and the name of anything else asked of it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls, self.used = tokenizer, [], []

    def __call__(self, texts, **kwargs):
        self.calls.append(list(texts))
        return self.tokenizer(texts, **kwargs)

    def __getattr__(self, name):
        self.used.append(name)
        return getattr(self.tokenizer, name)


def test_a_prompt_tokenized_once_is_not_tokenized_again(pre, monkeypatch):
    """The OpenAI layer counts a prompt's tokens with `tokenize_prompt` and hands them on: `process` takes them as
    they are, and still checks the request; a batch, or the chat template, is tokenized here."""
    ids = pre.tokenize_prompt("Hello world")
    [alone] = pre.process([request("Hello world")])
    [chat_alone] = pre.process([request("Hello world", APPLY_CHAT_TEMPLATE=np.array([[True]]))])
    [batch_alone] = pre.process([request("Hello", "world")])
    counting = CountingTokenizer(pre.tokenizer)
    monkeypatch.setattr(pre, "tokenizer", counting)
    [given] = pre.process([request("Hello world")], [ids])
    assert {k: v.tolist() for k, v in given.items()} == {k: v.tolist() for k, v in alone.items()}
    [too_long] = pre.process([request("Hello world", max_tokens=LIMITS.max_seq_len)], [ids])
    assert isinstance(too_long, InputError) and too_long.field == "max_tokens"
    assert counting.calls == [] and counting.used == []
    [chat] = pre.process([request("Hello world", APPLY_CHAT_TEMPLATE=np.array([[True]]))], [ids])
    [batch] = pre.process([request("Hello", "world")], [ids])  # the ids of one prompt do not answer two rows
    assert len(counting.calls) == 2 and "Hello world" in counting.calls[0][0] != "Hello world"
    assert counting.calls[1] == ["Hello", "world"]
    assert chat["INPUT_ID"].tolist() == chat_alone["INPUT_ID"].tolist() != alone["INPUT_ID"].tolist()
    assert batch["INPUT_ID"].tolist() == batch_alone["INPUT_ID"].tolist()


def test_batch_of_requests_each_answered(pre):
    results = pre.process([request("one"), request(""), request("three", max_tokens=0), request("four")])
    assert isinstance(results[0], dict) and isinstance(results[3], dict)
    assert isinstance(results[1], InputError) and results[1].field == "text_input"
    assert isinstance(results[2], InputError) and results[2].field == "max_tokens"


def test_chat_template_applied(pre, tokenizer):
    [out] = pre.process([request("Hi", APPLY_CHAT_TEMPLATE=np.array([[True]]))])
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out["INPUT_ID"][0].tolist() == list(expected)


@pytest.mark.parametrize(
    ("arrays", "field", "words"),
    [
        (request("   "), "text_input", "empty"),
        (request(b"\xff\xfe"), "text_input", "UTF-8"),
        (request("hi", max_tokens=0), "max_tokens", "between 1 and"),
        (request("hi", max_tokens=-5), "max_tokens", "between 1 and"),
        (request("hi", max_tokens=10_000), "max_tokens", "max sequence length 96"),
        (request("word " * 100), "text_input", "maximum input length of 64"),
        (request("hi", TEMPERATURE=np.array([[-1.0]], np.float32)), "temperature", ">= 0"),
        (request("hi", TEMPERATURE=np.array([[np.nan]], np.float32)), "temperature", "finite"),
        (request("hi", TOP_P=np.array([[-0.1]], np.float32)), "top_p", "[0, 1] (0 = unset)"),
        (request("hi", TOP_P=np.array([[1.5]], np.float32)), "top_p", "[0, 1] (0 = unset)"),
        (request("hi", TOP_K=np.array([[-1]], np.int32)), "top_k", ">= 0"),
        (request("hi", END_ID=np.array([[10**6]], np.int32)), "end_id", "below 49152"),
        (request("hi", STOP_WORDS_DICT=np.array([[b"x"] * (MAX_WORDS + 1)], dtype=object)), "stop_words", "limit"),
        (request("hi", BAD_WORDS_DICT=np.array([[b"x" * 1000]], dtype=object)), "bad_words", "bytes"),
        (request("hi", STOP_WORDS_DICT=np.array([[b"\xc3"]], dtype=object)), "stop_words", "UTF-8"),
    ],
)
def test_bad_inputs_name_the_field(pre, arrays, field, words):
    [result] = pre.process([arrays])
    assert isinstance(result, InputError)
    assert result.field == field
    assert words in str(result)


def test_missing_max_tokens(pre):
    arrays = request("hi")
    del arrays["REQUEST_OUTPUT_LEN"]
    [result] = pre.process([arrays])
    assert isinstance(result, InputError) and result.field == "max_tokens"


def test_stop_words_with_and_without_leading_space(pre, tokenizer):
    [out] = pre.process([request("hi", STOP_WORDS_DICT=np.array([[b"Paris", b""]], dtype=object))])
    words = parse_word_list(out["STOP_WORDS_IDS"][0])
    assert tuple(tokenizer.encode("Paris", add_special_tokens=False)) in words
    assert tuple(tokenizer.encode(" Paris", add_special_tokens=False)) in words


def test_word_list_round_trip():
    words = ((5,), (7, 8, 9), (1, 2))
    array = word_list(words)
    assert array.dtype == np.int32 and array.shape == (2, 6)
    assert array[1].tolist() == [1, 4, 6, -1, -1, -1]
    assert parse_word_list(array) == words
    assert parse_word_list(word_list([])) == ()


def test_embedding_bias_from_words_and_token_ids(pre, tokenizer):
    [out] = pre.process(
        [
            request(
                "Hello",
                EMBEDDING_BIAS_WORDS=np.array([[b"Paris", b" London"]], dtype=object),
                EMBEDDING_BIAS_WEIGHTS=np.array([[2.0, -np.inf]], np.float32),
                LOGIT_BIAS_TOKEN_IDS=np.array([[5, 5]], np.int32),
                LOGIT_BIAS_WEIGHTS=np.array([[1.0, 0.5]], np.float32),
            )
        ]
    )
    bias = out["EMBEDDING_BIAS"]
    assert bias.shape == (1, LIMITS.vocab_size)
    expected = np.zeros(LIMITS.vocab_size, np.float32)
    for token in tokenizer("Paris", add_special_tokens=False)["input_ids"]:
        expected[token] += 2.0
    for token in tokenizer(" London", add_special_tokens=False)["input_ids"]:
        expected[token] = -np.inf
    expected[5] += 1.5
    assert np.array_equal(bias[0], expected)


def test_no_bias_is_an_empty_tensor(pre):
    [out] = pre.process([request("Hello", "World")])
    assert out["EMBEDDING_BIAS"].shape == (2, 0)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (
            {
                "EMBEDDING_BIAS_WORDS": np.array([[b"a", b"b"]], dtype=object),
                "EMBEDDING_BIAS_WEIGHTS": np.array([[1.0]], np.float32),
            },
            "embedding_bias_weights",
        ),
        (
            {
                "LOGIT_BIAS_TOKEN_IDS": np.array([[LIMITS.vocab_size]], np.int32),
                "LOGIT_BIAS_WEIGHTS": np.array([[1.0]], np.float32),
            },
            "logit_bias_token_ids",
        ),
        (
            {
                "LOGIT_BIAS_TOKEN_IDS": np.array([[3]], np.int32),
                "LOGIT_BIAS_WEIGHTS": np.array([[np.inf]], np.float32),
            },
            "logit_bias_weights",
        ),
    ],
)
def test_bad_biases_name_the_input(pre, extra, field):
    [out] = pre.process([request("Hello", **extra)])
    assert isinstance(out, InputError) and out.field == field


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"BEAM_WIDTH": np.array([[2]], np.int32)}, "beam_width"),
        ({"BEAM_WIDTH": np.array([[0]], np.int32)}, "beam_width"),
        ({"GUIDED_DECODING_GUIDE_TYPE": np.array([[b"structural_tag"]], dtype=object)}, "guided_decoding_guide_type"),
        ({"GUIDED_DECODING_GUIDE": np.array([[b"[0-9]+"]], dtype=object)}, "guided_decoding_guide_type"),
        ({"GUIDED_DECODING_GUIDE_TYPE": np.array([[b"regex"]], dtype=object)}, "guided_decoding_guide"),
    ],
)
def test_what_the_tensorrt_llm_backend_would_ignore_or_fail_on_is_refused_here(pre, extra, field):
    [out] = pre.process([request("Hello", **extra)])
    assert isinstance(out, InputError) and out.field == field


def test_beam_width_up_to_the_engines(tokenizer):
    wide = Preprocessor(tokenizer, LIMITS, max_beam_width=4)
    [out] = wide.process([request("Hello", BEAM_WIDTH=np.array([[4]], np.int32))])
    assert not isinstance(out, InputError)


def guide(kind: str, text: str, **extra) -> dict:
    return request(
        "Pick a number.",
        GUIDED_DECODING_GUIDE_TYPE=np.array([[kind.encode()]], dtype=object),
        GUIDED_DECODING_GUIDE=np.array([[text.encode()]], dtype=object),
        **extra,
    )


BAD_GUIDES = [("regex", "[0-9"), ("json_schema", '{"type": 5}'), ("ebnf_grammar", "root ::= [0-9")]


@pytest.mark.parametrize(("kind", "text"), BAD_GUIDES)
def test_a_guide_that_does_not_compile_is_refused_before_the_tensorrt_llm_engine(tokenizer, kind, text):
    """TensorRT-LLM compiles a guide inside its batch step, where a bad one fails every request in flight: its
    flavor's preprocessing compiles each first, and refuses a bad one naming the input."""
    checking = Preprocessor(tokenizer, LIMITS, guides=GUIDES_COMPILED)
    [refused] = checking.process([guide(kind, text)])
    assert isinstance(refused, InputError) and refused.field == "guided_decoding_guide"
    assert f"the {kind} guide does not compile" in str(refused)
    [good] = checking.process(
        [guide(kind, {"regex": "[0-9]+", "json_schema": '{"type": "integer"}'}.get(kind, "root ::= [0-9]+"))]
    )
    assert not isinstance(good, Exception)


def test_the_portable_flavor_leaves_guides_to_its_engine(pre):
    """The portable engine compiles a guide with its tokenizer when the request arrives (a 400 there): no second
    compile here, so the text models never load xgrammar, and with it torch."""
    [passed] = pre.process([guide("regex", "[0-9")])
    assert not isinstance(passed, Exception)


def test_a_guide_with_more_than_one_beam_is_refused(tokenizer):
    """TensorRT-LLM's grammar follows the first beam only (GuidedDecoder::build)."""
    wide = Preprocessor(tokenizer, LIMITS, max_beam_width=4)
    [refused] = wide.process([guide("regex", "[0-9]+", BEAM_WIDTH=np.array([[2]], np.int32))])
    assert isinstance(refused, InputError) and refused.field == "beam_width"
    [beams] = wide.process([request("Pick a number.", BEAM_WIDTH=np.array([[2]], np.int32))])
    assert not isinstance(beams, Exception)


def test_guides_are_refused_by_name_where_the_engine_has_none(tokenizer):
    """A TensorRT-LLM engine built with guided decoding off (a tokenizer its grammar engine cannot read): a 400
    naming the input, not the executor's "GuidedDecoder is not setup"."""
    off = Preprocessor(tokenizer, LIMITS, guides=GUIDES_OFF)
    [refused] = off.process([guide("json", "")])
    assert isinstance(refused, InputError) and refused.field == "guided_decoding_guide_type"
    [plain] = off.process([request("Pick a number.")])
    assert not isinstance(plain, Exception)
