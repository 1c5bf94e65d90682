"""Unit: the error hierarchy (tritonllm.errors): each kind's status and Triton code, and its tag read back."""

from __future__ import annotations

import pytest

from tritonllm.errors import ConfigError, EngineFailure, ErrorKind, InputError, ServerBusy, TritonLLMError

# kind -> (OpenAI status, pb_utils.TritonError code name): the contract docs/api.md documents.
EXPECTED = {
    ErrorKind.INVALID_INPUT: (400, "INVALID_ARG"),
    ErrorKind.UNAUTHORIZED: (401, "INVALID_ARG"),
    ErrorKind.NOT_FOUND: (404, "NOT_FOUND"),
    ErrorKind.TOO_LARGE: (413, "INVALID_ARG"),
    ErrorKind.BUSY: (429, "UNAVAILABLE"),
    ErrorKind.UNAVAILABLE: (503, "UNAVAILABLE"),
    ErrorKind.INTERNAL: (500, "INTERNAL"),
}


def test_every_kind_has_its_status_and_code():
    assert set(EXPECTED) == set(ErrorKind)
    for kind, (status, code) in EXPECTED.items():
        assert (kind.http_status, kind.triton_code) == (status, code), kind


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_the_tag_reads_back_wherever_triton_puts_it(kind):
    assert kind.tag == f"[{kind.name.lower()}]"
    assert ErrorKind.of_message(f"{kind.tag} max_tokens: out of range") is kind
    assert ErrorKind.of_message(f"in ensemble 'ensemble', {kind.tag} something") is kind  # Triton's prefix


@pytest.mark.parametrize("message", ["", "server busy", "[unknown_kind] x", "invalid_input", "[INVALID_INPUT] x"])
def test_an_untagged_message_has_no_kind(message):
    assert ErrorKind.of_message(message) is None


def test_the_first_tag_wins():
    assert ErrorKind.of_message("[busy] a prompt that says [invalid_input]") is ErrorKind.BUSY


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (InputError("top_p", "must be in (0, 1]"), ErrorKind.INVALID_INPUT),
        (ServerBusy("retry later"), ErrorKind.BUSY),
        (EngineFailure("the engine stopped"), ErrorKind.INTERNAL),
        (ConfigError("no such folder"), ErrorKind.INVALID_INPUT),
        (TritonLLMError("unclassified"), ErrorKind.INTERNAL),
    ],
)
def test_each_error_carries_its_kind_and_tags_its_message(error, kind):
    assert error.kind is kind
    assert error.tagged() == f"{kind.tag} {error}"
    assert ErrorKind.of_message(error.tagged()) is kind


def test_an_input_error_names_its_input():
    error = InputError("stop_words", "a word is 300 bytes")
    assert (error.field, str(error)) == ("stop_words", "stop_words: a word is 300 bytes")
    assert isinstance(error, ValueError)
