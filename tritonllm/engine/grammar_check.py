"""Whether a guide compiles, without a tokenizer: the check in front of an engine that compiles it too late.

TensorRT-LLM's C++ runtime compiles a request's grammar inside its batch step, where one that xgrammar refuses
fails every request in flight; so the TensorRT-LLM flavor's preprocessing compiles each guide first, with the
same library (xgrammar, which NVIDIA's image ships), and refuses a bad one by name. The portable engine
compiles guides at submission with its tokenizer (tritonllm/engine/guided.py) and needs no second compile.
xgrammar imports torch, so it is imported at the first guide only.
"""

from __future__ import annotations

import re
from functools import lru_cache

from tritonllm.errors import InputError

GUIDE_FIELD = "guided_decoding_guide"
CHECKED_GUIDES_KEPT = 256  # distinct guides whose verdict is kept
# A request whose guide has not compiled within this fails: xgrammar's compile cannot be stopped, and a few
# pathological regular expressions or grammars would otherwise hold up every guided request behind them.
GUIDE_COMPILE_SECONDS = 30.0
# xgrammar's errors start with a time stamp, its source file and line, and for checks the failed condition.
_XGRAMMAR_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def xgrammar_reason(exc: Exception) -> str:
    """The first line of an xgrammar error, without its time stamp and source location."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return _XGRAMMAR_NOISE.sub("", lines[0]).strip() if lines else type(exc).__name__


def not_compiling(kind: str, exc: Exception) -> InputError:
    return refused(kind, xgrammar_reason(exc))


def refused(kind: str, reason: str) -> InputError:
    return InputError(GUIDE_FIELD, f"the {kind} guide does not compile: {reason}")


def compile_too_slow(kind: str, seconds: float) -> InputError:
    return InputError(GUIDE_FIELD, f"the {kind} guide did not compile within the limit of {seconds:g} s")


def check_guide(kind: str, text: str) -> None:
    """InputError naming guided_decoding_guide unless xgrammar compiles the guide (a type of protocol.GUIDE_TYPES;
    "json", any JSON, has nothing to compile)."""
    if kind == "json":
        return
    try:
        reason = compile_failure(kind, text)
    except MemoryError as exc:  # not the guide's verdict, so not kept: it may compile once memory is back
        raise not_compiling(kind, exc) from None
    if reason is not None:
        raise refused(kind, reason)


@lru_cache(maxsize=CHECKED_GUIDES_KEPT)
def compile_failure(kind: str, text: str) -> str | None:
    """Why xgrammar refuses the guide, None when it compiles. Kept for both: a verdict depends on the guide alone, and
    a client that repeats a bad one (a large grammar refused at its end) would otherwise pay its parse each time. An
    lru_cache keeps no exception, hence a reason returned rather than raised."""
    import xgrammar

    build = {
        "json_schema": xgrammar.Grammar.from_json_schema,
        "regex": xgrammar.Grammar.from_regex,
        "ebnf_grammar": xgrammar.Grammar.from_ebnf,
    }[kind]
    try:
        build(text)
    except MemoryError:
        raise
    except Exception as exc:
        return xgrammar_reason(exc)
    return None
