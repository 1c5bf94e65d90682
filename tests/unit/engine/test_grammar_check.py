"""Unit: check_guide, the compile in front of the TensorRT-LLM engines, keeps its verdicts (a guide that compiles and
one that does not are each compiled once, within a bounded number of distinct guides) and is bounded as the portable
engine's compiles are: a deadline per request, a few compiles at once."""

from __future__ import annotations

import sys
import threading
import time
import types
from types import SimpleNamespace

import pytest

from tests.polling import eventually
from tritonllm.engine import grammar_check
from tritonllm.engine.grammar_check import (
    CHECKED_GUIDES_KEPT,
    GUIDE_COMPILERS,
    GUIDE_FIELD,
    GuideCompiles,
    check_guide,
)
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

    grammar_check._CHECKS.clear()
    yield compiled
    grammar_check._CHECKS.clear()


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
    checks = grammar_check._CHECKS
    checks.clear()
    before = checks.compilations
    first, again = (refusal("(unclosed") for _ in range(2))
    assert first == again and "does not compile" in first and "regex_converter" not in first
    assert checks.compilations == before + 1
    checks.clear()


@pytest.fixture
def slow_checks(monkeypatch) -> SimpleNamespace:
    """check_guide over a stand-in parse that sleeps as many seconds as a regex guide's text says, under a deadline of
    0.3 s; what it parsed, and how many parses ran at once at most."""
    state, lock = SimpleNamespace(parsed=[], running=0, most=0), threading.Lock()

    def parse_slowly(kind: str, text: str) -> None:
        with lock:
            state.parsed.append(text)
            state.running += 1
            state.most = max(state.most, state.running)
        time.sleep(float(text))
        with lock:
            state.running -= 1

    monkeypatch.setattr(grammar_check, "_CHECKS", GuideCompiles(parse_slowly, CHECKED_GUIDES_KEPT, seconds=0.3))
    return state


def test_a_check_past_the_deadline_is_refused_by_name_and_not_waited_for_again(slow_checks):
    """TensorRT-LLM's preprocessing and the LLM API's submit check each guide on a thread of the server's: a
    pathological guide must not hold it for as long as xgrammar takes."""
    started = time.monotonic()
    late = refusal("0.8")
    assert time.monotonic() - started < 0.6, "it waited the parse, not the deadline"
    assert late == f"{GUIDE_FIELD}: the regex guide did not compile within the limit of 0.3 s"
    started = time.monotonic()
    assert refusal("0.8") == late and time.monotonic() - started < 0.1  # at once, while it still parses
    assert slow_checks.parsed == ["0.8"]
    check_guide("regex", "0.01")


def test_at_most_a_few_checks_parse_at_once(slow_checks):
    threads = [threading.Thread(target=refusal, args=(f"0.5{i}",)) for i in range(2 * GUIDE_COMPILERS + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert eventually(lambda: len(slow_checks.parsed) == len(threads) and slow_checks.running == 0, 10)
    assert slow_checks.most == GUIDE_COMPILERS
