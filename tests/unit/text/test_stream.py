"""Streaming detokenization on token streams shaped like the engines' decoupled responses.

Both engines send only the new tokens in each streaming response (one or several). Whatever the
chunking, the deltas joined must equal the request/response text byte for byte, no delta may hold
U+FFFD for a character still being completed, and no delta may be empty.
"""

import random

import pytest

from tritonllm.text.detokenization import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    REPLACEMENT,
    Detokenizer,
    finish_reason,
    token_bytes_table,
    truncate_at_stop,
)
from tritonllm.text.stream import StopFilter, TextStream

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3.14, isn't it?",
    "chinese": "秋天来了，树叶变黄了，一片片落下来。天空很蓝，空气很清新。",
    "japanese": "東京は日本の首都です。ひらがなとカタカナ、そして漢字。",
    "emoji": "Party time 🎉🥳 with family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵!",
    "code": "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "mixed": "Résumé: naïve café — 中文 and English\ttabs\n\nnew paragraph",
}


def chunks(ids, sizes):
    i = 0
    for size in sizes:
        if i >= len(ids):
            return
        yield ids[i : i + size]
        i += size
    if i < len(ids):
        yield ids[i:]


def run_stream(detok, ids, sizes, stops=()):
    stream = TextStream(detok, stops)
    deltas = []
    for chunk in chunks(ids, sizes):
        delta = stream.push(chunk)
        if delta:
            deltas.append(delta)
        if stream.stopped:
            break
    tail = stream.finish()
    if tail:
        deltas.append(tail)
    return deltas, stream


@pytest.fixture(scope="module")
def detok(tokenizer):
    return Detokenizer(tokenizer)


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("pattern", ["one", "two", "random"])
def test_joined_deltas_equal_whole_decode(tokenizer, detok, name, pattern):
    ids = tokenizer(TEXTS[name], add_special_tokens=False)["input_ids"]
    sizes = {"one": [1] * len(ids), "two": [2] * len(ids), "random": [random.Random(7).randint(1, 4) for _ in ids]}
    deltas, stream = run_stream(detok, ids, sizes[pattern])
    assert "".join(deltas) == detok.decode(ids) == TEXTS[name]
    assert all(deltas), "no empty deltas"
    assert not any(REPLACEMENT in d for d in deltas)
    assert stream.num_tokens == len(ids)


@pytest.mark.parametrize("name", ["chinese", "emoji", "japanese"])
def test_cut_at_every_length_matches_request_response_text(tokenizer, detok, name):
    """A stream cut by max_tokens at any point gives exactly the ensemble's text, with no broken character."""
    ids = tokenizer(TEXTS[name], add_special_tokens=False)["input_ids"]
    for n in range(1, len(ids) + 1):
        deltas, _ = run_stream(detok, ids[:n], [1] * n)
        assert "".join(deltas) == detok.decode(ids[:n])
        assert not any(REPLACEMENT in d for d in deltas)


def test_partial_character_is_held_back(tokenizer, detok):
    ids = tokenizer("中国的首都是北京", add_special_tokens=False)["input_ids"]
    stream = TextStream(detok)
    for token in ids:
        delta = stream.push([token])
        assert REPLACEMENT not in delta
    assert stream.finish() == ""


def test_invalid_model_bytes_still_come_through(tokenizer, detok):
    table = token_bytes_table(tokenizer)
    stray = next(i for i, b in enumerate(table) if b == b"\x80")
    ids = (
        tokenizer("ok ", add_special_tokens=False)["input_ids"]
        + [stray]
        + tokenizer("done", add_special_tokens=False)["input_ids"]
    )
    deltas, _ = run_stream(detok, ids, [1] * len(ids))
    assert "".join(deltas) == "ok " + REPLACEMENT + "done"


def test_special_tokens_skipped_in_stream(tokenizer, detok):
    ids = tokenizer("Hello there", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    deltas, _ = run_stream(detok, ids, [1] * len(ids))
    assert "".join(deltas) == "Hello there"


@pytest.mark.parametrize(
    ("text", "stops"),
    [
        ("The capital of France is Paris. It is big.", ["Paris"]),
        ("The capital of France is Paris. It is big.", ["is Par"]),  # spans tokens
        ("The capital of France is Paris. It is big.", ["aris."]),  # starts inside a token
        ("秋天来了，树叶变黄了，一片片落下来。", ["变黄"]),
        ("a b c d e", ["x", "c d"]),
        ("no stop here at all", ["zebra"]),
        ("Party 🎉🥳 time", ["🥳"]),
    ],
)
@pytest.mark.parametrize("size", [1, 3])
def test_stop_strings(tokenizer, detok, text, stops, size):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas, stream = run_stream(detok, ids, [size] * len(ids), stops)
    joined = "".join(deltas)
    assert joined == truncate_at_stop(text, stops)
    assert all(deltas)
    assert not any(s in joined for s in stops)
    assert stream.stopped == any(s in text for s in stops)


def test_prefix_of_a_stop_is_held_then_released():
    f = StopFilter(["Paris"])
    assert f.push("in Par") == "in "
    assert f.push("ma") == "Parma"
    assert f.push(" or Pa") == " or "
    assert f.push("ris!") == ""
    assert f.stopped and f.finish() == ""
    g = StopFilter(["Paris"])
    assert g.push("to Pa") == "to "
    assert g.finish() == "Pa", "held text is released when generation ends without the stop"


def test_finish_reason():
    assert finish_reason(True, 5, 5) == FINISH_STOP
    assert finish_reason(False, 5, 5) == FINISH_LENGTH
    assert finish_reason(False, 3, 5) == FINISH_EOS
