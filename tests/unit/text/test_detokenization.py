"""Detokenization: the tokenizer's text, minus a character cut short, and stop-string trimming."""

import numpy as np
import pytest

from tritonllm.text.detokenization import (
    REPLACEMENT,
    Detokenizer,
    Postprocessor,
    incomplete_utf8_tail,
    token_bytes_table,
    truncate_at_stop,
)

TEXTS = [
    "Hello, world!",
    "中国的首都是北京。",
    "日本語のテキスト",
    "emoji 🎉👍🏽 done",
    "def f(x):\n    return x  # ok",
]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"abc", 0),
        ("中".encode(), 0),
        ("中".encode()[:1], 1),
        ("中".encode()[:2], 2),
        ("🎉".encode()[:3], 3),
        ("🎉".encode()[:1], 1),
        (b"ab\x80", 0),  # a stray continuation byte is invalid, not unfinished
        (b"\xed\xa0", 0),  # a surrogate's prefix can never become valid
        (b"\xe4A", 0),
        (b"", 0),
    ],
)
def test_incomplete_utf8_tail(data, expected):
    assert incomplete_utf8_tail(data) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_rebuild_text(tokenizer, text):
    table = token_bytes_table(tokenizer)
    assert table is not None, "SmolLM2's byte-level BPE must be understood"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert b"".join(table[i] for i in ids) == text.encode()


def test_special_tokens_have_no_bytes(tokenizer):
    table = token_bytes_table(tokenizer)
    assert table[tokenizer.eos_token_id] == b""


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_tokenizer_for_whole_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert Detokenizer(tokenizer).decode(ids) == tokenizer.decode(ids) == text


def test_cut_character_is_dropped(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer("中国的首都是北京", add_special_tokens=False)["input_ids"]
    table = token_bytes_table(tokenizer)
    cut_points = [n for n in range(1, len(ids)) if incomplete_utf8_tail(b"".join(table[i] for i in ids[:n]))]
    assert cut_points, "this text must have a character split across tokens"
    for n in cut_points:
        raw = tokenizer.decode(ids[:n])
        assert raw.endswith(REPLACEMENT)
        text = detok.decode(ids[:n])
        assert REPLACEMENT not in text
        assert "中国的首都是北京".startswith(text)


def test_invalid_bytes_from_the_model_are_kept(tokenizer):
    table = token_bytes_table(tokenizer)
    stray = next(i for i, b in enumerate(table) if b == b"\x80")  # a lone continuation byte
    ids = (
        tokenizer("ok ", add_special_tokens=False)["input_ids"]
        + [stray]
        + tokenizer("done", add_special_tokens=False)["input_ids"]
    )
    assert Detokenizer(tokenizer).decode(ids) == "ok " + REPLACEMENT + "done"


def test_special_tokens_skipped(tokenizer):
    ids = tokenizer("Paris.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert Detokenizer(tokenizer).decode(ids) == "Paris."
    assert Detokenizer(tokenizer, skip_special_tokens=False).decode(ids) == "Paris." + tokenizer.eos_token


def test_decode_batch_equals_decode(tokenizer):
    detok = Detokenizer(tokenizer)
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"][:3] for t in TEXTS]
    assert detok.decode_batch(seqs) == [detok.decode(s) for s in seqs]


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("The capital is Paris. Yes", ["Paris"], "The capital is "),
        ("a b c", ["c", "b"], "a "),
        ("abc", [], "abc"),
        ("abc", [""], "abc"),
        ("abc", ["x"], "abc"),
    ],
)
def test_truncate_at_stop(text, stops, expected):
    assert truncate_at_stop(text, stops) == expected


def test_postprocessor_shapes_and_stop(tokenizer):
    post = Postprocessor(Detokenizer(tokenizer))
    ids = tokenizer(" Paris is nice", add_special_tokens=False)["input_ids"]
    tokens = np.zeros((2, 1, len(ids) + 2), dtype=np.int32)
    tokens[0, 0, : len(ids)] = ids
    tokens[1, 0, :2] = ids[:2]
    lengths = np.array([[len(ids)], [2]], dtype=np.int32)
    [out] = post.process([{"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": lengths}])
    assert out["OUTPUT"].shape == (2,)
    assert out["OUTPUT"][0].decode() == " Paris is nice"
    assert out["OUTPUT"][1].decode() == tokenizer.decode(ids[:2])
    stops = np.array([[b" nice"], [b"zzz"]], dtype=object)
    [out] = post.process([{"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": lengths, "STOP_WORDS": stops}])
    assert out["OUTPUT"][0].decode() == " Paris is"
    assert out["OUTPUT"][1].decode() == tokenizer.decode(ids[:2])


def test_postprocessor_finish_reason(tokenizer):
    post = Postprocessor(Detokenizer(tokenizer))
    ids = tokenizer(" Paris is nice", add_special_tokens=False)["input_ids"]
    tokens = np.array([[ids]], dtype=np.int32)
    lengths = np.array([[len(ids)]], dtype=np.int32)

    def reason(**extra):
        [out] = post.process([{"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": lengths, **extra}])
        return out["FINISH_REASON"][0].decode()

    assert reason(REQUEST_OUTPUT_LEN=np.array([[len(ids)]], np.int32)) == "length"
    assert reason(REQUEST_OUTPUT_LEN=np.array([[len(ids) + 5]], np.int32)) == "eos"
    assert (
        reason(REQUEST_OUTPUT_LEN=np.array([[len(ids)]], np.int32), STOP_WORDS=np.array([[b"nice"]], dtype=object))
        == "stop"
    )


def test_prompt_in_the_tokens_leads_the_text_and_is_not_cut_or_counted(tokenizer):
    post = Postprocessor(Detokenizer(tokenizer))
    prompt = tokenizer("Stop here. Then", add_special_tokens=False)["input_ids"]
    generated = tokenizer(" go on. Stop", add_special_tokens=False)["input_ids"]
    tokens = np.array([[prompt + generated]], dtype=np.int32)
    arrays = {
        "TOKENS_BATCH": tokens,
        "SEQUENCE_LENGTH": np.array([[tokens.shape[-1]]], np.int32),
        "STOP_WORDS": np.array([[b"Stop"]], dtype=object),
        "REQUEST_OUTPUT_LEN": np.array([[len(generated) + 3]], np.int32),
        "INPUT_LENGTH": np.array([[len(prompt)]], np.int32),
        "EXCLUDE_INPUT_IN_OUTPUT": np.array([[False]]),
    }
    [out] = post.process([arrays])
    assert out["OUTPUT"][0].decode() == "Stop here. Then go on. "
    assert out["FINISH_REASON"][0].decode() == "stop"
    arrays["STOP_WORDS"] = np.array([[b"zzz"]], dtype=object)
    [out] = post.process([arrays])
    assert out["FINISH_REASON"][0].decode() == "eos"  # len(generated) < max_tokens, the prompt not counted
