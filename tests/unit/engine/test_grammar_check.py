"""Unit: check_guide, the compile in front of the TensorRT-LLM engines, keeps its verdicts: a guide that compiles and
one that does not are each compiled once, within a bounded number of distinct guides."""

from __future__ import annotations

import sys
import types

import pytest

from tritonllm.engine import grammar_check
from tritonllm.engine.grammar_check import CHECKED_GUIDES_KEPT, GUIDE_FIELD, check_guide
from tritonllm.errors import InputError


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """A stand-in xgrammar whose regex compile records each guide it is given, refusing those starting with "(" and
    running out of memory on "oom"; the module's kept verdicts are cleared before and after."""
    compiled: list[str] = []

    def from_regex(text: str) -> None:
        compiled.append(text)
        if text == "oom":
            raise MemoryError
        if text.startswith("("):
            raise RuntimeError("[12:00:00] /project/cpp/regex_converter.cc:94: Regex parsing error: unbalanced")

    grammar = types.SimpleNamespace(from_regex=from_regex, from_json_schema=from_regex, from_ebnf=from_regex)
    monkeypatch.setitem(sys.modules, "xgrammar", types.SimpleNamespace(Grammar=grammar))

    def clear() -> None:
        for value in vars(grammar_check).values():
            getattr(value, "cache_clear", lambda: None)()

    clear()
    yield compiled
    clear()


def refusal(text: str) -> str:
    with pytest.raises(InputError) as err:
        check_guide("regex", text)
    assert err.value.field == GUIDE_FIELD
    return str(err.value)


def test_a_guide_that_compiles_is_compiled_once(compiles):
    for _ in range(3):
        check_guide("regex", "a+")
    assert compiles == ["a+"]


def test_a_guide_that_does_not_compile_is_compiled_once(compiles):
    """Each refusal is a new error with the same reason, not the guide compiled again: a client repeating a large bad
    grammar would otherwise pay its parse on every request (a tenth of a second for half a megabyte of EBNF)."""
    reasons = {refusal("(a") for _ in range(3)}
    assert compiles == ["(a"]
    assert reasons == {f"{GUIDE_FIELD}: the regex guide does not compile: Regex parsing error: unbalanced"}


def test_kept_verdicts_are_bounded(compiles):
    for i in range(CHECKED_GUIDES_KEPT + 1):
        refusal(f"({i}")
    refusal("(0")  # the oldest verdict made room for the newest
    assert len(compiles) == CHECKED_GUIDES_KEPT + 2 and compiles[-1] == "(0"


def test_running_out_of_memory_is_not_kept_as_the_guides_verdict(compiles):
    assert "does not compile" in refusal("oom")
    compiles.clear()
    refusal("oom")
    assert compiles == ["oom"], "compiled again: memory may be there now"


def test_json_has_nothing_to_compile(compiles):
    check_guide("json", "")
    assert compiles == []


def test_xgrammars_own_refusal_is_kept_with_its_reason():
    pytest.importorskip("xgrammar")
    grammar_check.compile_failure.cache_clear()
    first, again = (refusal("(unclosed") for _ in range(2))
    assert first == again and "does not compile" in first and "regex_converter" not in first
    assert grammar_check.compile_failure.cache_info().hits == 1
    grammar_check.compile_failure.cache_clear()
