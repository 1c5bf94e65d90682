"""Guide compiles: the schedule every compile of a guide goes through, and the check in front of an engine that
compiles a guide too late.

`GuideCompiles` runs one compile per distinct guide, shared by the requests for it, on a few threads of its own, each
request waiting a bounded time: the portable engine's compiles with its tokenizer (tritonllm/engine/guided.py) and
the tokenizer-free check below both go through it, so a slow guide holds up neither a thread of its caller nor the
guides behind it.

TensorRT-LLM's runtime compiles a request's grammar inside its batch step, where one that xgrammar refuses fails
every request in flight; so the TensorRT-LLM flavors compile each guide first, with the same library (xgrammar,
which NVIDIA's images ship), and refuse a bad one by name (`check_guide`). xgrammar imports torch, so it is imported
at the first guide only.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import SimpleQueue

from tritonllm.errors import InputError

GUIDE_FIELD = "guided_decoding_guide"
CHECKED_GUIDES_KEPT = 256  # distinct guides whose check's verdict is kept
GUIDE_COMPILERS = 2  # guides compiled at once (each compile may use threads of xgrammar's own); others wait their turn
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
    return InputError(GUIDE_FIELD, f"the {kind} guide does not compile: {xgrammar_reason(exc)}")


def compile_too_slow(kind: str, seconds: float) -> InputError:
    return InputError(GUIDE_FIELD, f"the {kind} guide did not compile within the limit of {seconds:g} s")


@dataclass(eq=False)
class _Compilation:
    """A guide's compile, which the requests for that guide share."""

    future: Future = field(default_factory=Future)
    running: bool = False  # a compiler thread has taken it up
    expired: bool = False  # it ran past a request's deadline: the guide's requests fail at once until it ends


class GuideCompiles:
    """`compile(kind, text)` run once per distinct guide on at most `compilers` threads, in the order the guides came;
    a request waits `seconds` at most. Kept, up to `kept` guides: each result, and each refusal of the guide's own
    (an InputError); not kept: any other failure (memory, the tokenizer), which is not the guide's verdict."""

    def __init__(
        self,
        compile: Callable[[str, str], object],
        kept: int,
        seconds: float = GUIDE_COMPILE_SECONDS,
        compilers: int = GUIDE_COMPILERS,
    ) -> None:
        self._compile = compile
        self.kept = kept
        self.seconds = seconds
        self.compilers = compilers
        self.compilations = 0  # compiles started so far (a kept guide is not compiled again)
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], _Compilation] = OrderedDict()
        self._waiting: SimpleQueue[tuple[tuple[str, str], _Compilation]] = SimpleQueue()
        self._threads: list[threading.Thread] = []

    def result(self, kind: str, text: str) -> object:
        """What `compile` returns for the guide; its InputError; or an InputError naming guided_decoding_guide when it
        has not compiled within the deadline (at once while an expired compile of it still runs)."""
        key = (kind, text)
        with self._lock:
            compilation = self._compiled.get(key)
            if compilation is None:
                compilation = self._compiled[key] = _Compilation()
                while len(self._compiled) > self.kept:
                    self._compiled.popitem(last=False)
                self._waiting.put((key, compilation))
                if len(self._threads) < self.compilers:
                    # Daemons: a compile that xgrammar cannot stop must not hold up the process's exit.
                    thread = threading.Thread(target=self._compile_loop, name="guide-compiler", daemon=True)
                    thread.start()
                    self._threads.append(thread)
            elif compilation.expired:  # its compile runs on: failed at once, not waited for again
                raise compile_too_slow(kind, self.seconds)
            else:
                self._compiled.move_to_end(key)
        try:
            return compilation.future.result(self.seconds)
        except futures.TimeoutError:  # TimeoutError itself from Python 3.11
            with self._lock:  # one still waiting for a compiler is not the guide's fault: it compiles for later ones
                compilation.expired = compilation.running
            raise compile_too_slow(kind, self.seconds) from None
        except InputError as exc:  # a new error each time: a kept one would grow a traceback per raise
            raise InputError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None

    def clear(self) -> None:
        """Forgets every kept verdict; compiles under way finish for their requests."""
        with self._lock:
            self._compiled.clear()

    def _compile_loop(self) -> None:
        while True:
            key, compilation = self._waiting.get()
            with self._lock:
                compilation.running = True
                self.compilations += 1
            compiled, error = None, None
            try:
                compiled = self._compile(*key)
            except Exception as exc:
                error = exc
            with self._lock:
                # Not kept: a failure that is not the guide's, and the success of a compile that expired, which is
                # nobody's (a guide's verdict does not hang on timing: a later request compiles it anew).
                kept = isinstance(error, InputError) if error is not None else not compilation.expired
                if not kept and self._compiled.get(key) is compilation:
                    del self._compiled[key]
                if error is None:
                    compilation.future.set_result(compiled)
                else:
                    compilation.future.set_exception(error)


def check_guide(kind: str, text: str) -> None:
    """InputError naming guided_decoding_guide unless xgrammar compiles the guide (a type of protocol.GUIDE_TYPES;
    "json", any JSON, has nothing to compile) within GUIDE_COMPILE_SECONDS."""
    if kind == "json":
        return
    try:
        _CHECKS.result(kind, text)
    except MemoryError as exc:  # not the guide's verdict, so not kept: it may compile once memory is back
        raise not_compiling(kind, exc) from None


def _parse(kind: str, text: str) -> None:
    """xgrammar's parse of the guide, which needs no tokenizer; InputError with its reason when it refuses."""
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
        raise not_compiling(kind, exc) from None


_CHECKS = GuideCompiles(_parse, CHECKED_GUIDES_KEPT)
