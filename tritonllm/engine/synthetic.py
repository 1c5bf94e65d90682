"""A benchmark instrument, never a default: an engine that writes a fixed passage at a set time per step.

Built with `build_engines.py --engine synthetic --step-ms 6`, it sits behind the same `tensorrt_llm` model as the
portable engine (tritonllm/backend/engine_model.py) with the same interface: streaming or not, end_id,
stop_words_list, max tokens, TensorRT-LLM's `stop` request and cancellation, the same outputs and metrics. Every
step it gives each running sequence (up to max_batch_size; the others wait in order) its next token of a passage the
build tokenized with the model's tokenizer, so the preprocessing, postprocessing, streaming and OpenAI steps do
their real work on real text, while the engine costs a few microseconds of one thread per token. What it cannot
honour it refuses, naming the input: sampling, penalties, biases, log probabilities, guides, bad words.

It is also a fault-injection instrument for tests (tests/integration/test_faults.py): with `fault_at_step` set in
synthetic_engine.json (not a build option), a step raises inside the step loop, whose guard then fails every request
as it would on a bug of ours. Armed by a file (`fault_file`), the fault fires once: the step that fires removes the
file, so the engine the watchdog starts in the faulted one's place serves, and a test can arm it when it chooses.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tritonllm.engine.api import BlockingGenerate, Emission, GenerationRequest, SubmitRules
from tritonllm.engine.checks import check_submit
from tritonllm.engine.lifecycle import Lifecycle
from tritonllm.errors import EngineFailure
from tritonllm.options import option
from tritonllm.protocol import FINISH_CANCELLED, FINISH_ERROR

log = logging.getLogger(__name__)

SYNTHETIC_CONFIG_FILE = "synthetic_engine.json"  # beside the engine model, where the portable one has engine.json
# What the synthetic engine writes, cycled; each request starts at an offset chosen by its prompt. Mixed scripts so
# that detokenization meets multi-byte characters split across tokens, as with real models.
PASSAGE = (
    "The river carried the morning light past the old mill, where the wheel turned slowly and the miller counted "
    "sacks of grain. Children ran along the bank, shouting names into the wind, and a heron lifted itself from the "
    "reeds without a sound. In the square the market opened: bread, cheese, café au lait, and crates of apples "
    "from the hills. 北京的秋天很美。 Travellers asked the way to the bridge; the answer was always "
    "the same, follow the water until the road bends, then keep the church tower on your left. By noon the clouds "
    "had gathered over the valley, and the first drops of rain fell on the stones of the quay. "
)


@dataclass(frozen=True)
class SyntheticConfig:
    """The synthetic engine's configuration; the build writes it as synthetic_engine.json. `step_ms` is a build
    option (tritonllm/options.py)."""

    text_ids: tuple[int, ...]  # PASSAGE in the model's tokenizer
    max_batch_size: int = 16
    step_ms: float = option(
        6.0, "milliseconds per engine step; each step gives every running sequence its next token", limits=(0.1, None)
    )
    # The step loop in a process of its own, as the portable engine's on CUDA (--engine-process, EngineConfig's).
    engine_process: bool = False
    # Fault injection, for tests: from this step on (counted from the engine's start, its warm-up included; 0:
    # never), the first step at which the fault is armed raises RuntimeError("injected fault at step N").
    fault_at_step: int = 0
    # Armed: with no file named, always (every start of the engine faults again); else only while this file
    # exists, and the step that fires removes it (once, whichever engine of the server claims it first).
    fault_file: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "text_ids", tuple(self.text_ids))  # JSON gives a list


@dataclass(eq=False)
class _Sequence(Lifecycle):
    position: int  # where in the passage its next token is


class SyntheticEngine(BlockingGenerate):
    """One thread: every step, the next token for each running sequence; the portable engine's interface."""

    submit_rules = SubmitRules(fixed_text=True)

    def __init__(self, config: SyntheticConfig) -> None:
        if not config.text_ids:
            raise ValueError("the synthetic engine needs the passage's token ids (text_ids)")
        self.config = config
        self._step_s = config.step_ms / 1000
        self._lock = threading.RLock()  # emit callbacks run under it and may ask running() or cancel()
        self._ids = itertools.count()
        self._sequences: dict[str, _Sequence] = {}  # submitted and not finished, in order
        self._waiting: deque[str] = deque()
        self._batch: dict[str, _Sequence] = {}
        self._work = threading.Event()
        self._stopping = threading.Event()
        self._stopped: str | None = None  # why the engine takes no more requests (_fail_all)
        self._finished_steps = 0
        self._loop_thread = threading.Thread(target=self._loop, name="synthetic-engine", daemon=True)
        self._loop_thread.start()

    def submit(self, request: GenerationRequest, emit: Callable[[Emission], None]) -> str:
        check_submit(request, self.submit_rules)
        request_id = f"s{next(self._ids)}"
        start = zlib.crc32(bytes(str(request.input_ids), "ascii")) % len(self.config.text_ids)
        with self._lock:  # under the lock _fail_all holds: a request is refused here or finished there, never lost
            if self._stopped is not None:
                raise EngineFailure(f"{self._stopped} (see the server log)")
            self._sequences[request_id] = _Sequence(start, request=request, emit=emit)
            self._waiting.append(request_id)
        self._work.set()
        return request_id

    def cancel(self, request_id: str) -> None:
        with self._lock:
            sequence = self._take(request_id)
            if sequence is not None:
                sequence.finish(FINISH_CANCELLED)

    def running(self) -> int:
        return len(self._sequences)

    def in_batch(self) -> int:
        return len(self._batch)

    def alive(self) -> bool:
        return self._loop_thread.is_alive()

    def steps(self) -> int:
        return self._finished_steps

    def shutdown(self) -> None:
        self._stopping.set()
        self._work.set()
        self._loop_thread.join(timeout=5)
        self._fail_all("the engine is shutting down")

    def _fail_all(self, error: str) -> None:
        """Ends every request with `error`; the engine takes no more (submit raises)."""
        with self._lock:
            self._stopped = error
            for request_id in list(self._sequences):
                self._take(request_id).finish(FINISH_ERROR, error)

    # ------------------------------------------------------------------ the step loop

    def _loop(self) -> None:
        try:
            self._steps()
        except Exception as exc:  # a bug: every request learns it, none waits forever; alive() now says False
            log.exception("the synthetic engine's step loop failed")
            self._fail_all(f"the engine's step loop failed: {exc}")

    def _steps(self) -> None:
        next_step = time.monotonic()
        while not self._stopping.is_set():
            if not self._sequences:
                self._work.wait(0.1)
                self._work.clear()
                next_step = time.monotonic() + self._step_s  # a request's first token takes one step
                continue
            delay = next_step - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            # A late step is not made up for with a burst: the next one is a full step after this one.
            next_step = max(next_step + self._step_s, time.monotonic())
            with self._lock:
                while self._waiting and len(self._batch) < self.config.max_batch_size:
                    request_id = self._waiting.popleft()
                    self._batch[request_id] = self._sequences[request_id]
                    self._batch[request_id].scheduled = time.perf_counter()
                self._inject_fault()
                for request_id, sequence in list(self._batch.items()):
                    self._advance(request_id, sequence)
            self._finished_steps += 1

    def _inject_fault(self) -> None:
        """Raises in the step when the configuration's fault is due and armed (SyntheticConfig.fault_at_step)."""
        step, config = self._finished_steps + 1, self.config
        if not config.fault_at_step or step < config.fault_at_step:
            return
        if config.fault_file:
            try:
                os.remove(config.fault_file)  # the claim: of engines sharing the file, one fires
            except FileNotFoundError:
                return
        raise RuntimeError(f"injected fault at step {step}")

    def _advance(self, request_id: str, sequence: _Sequence) -> None:
        request, text = sequence.request, self.config.text_ids
        token = text[sequence.position % len(text)]
        sequence.position += 1
        if token == request.end_id and len(sequence.tokens) < request.penalties.min_tokens:
            token = text[sequence.position % len(text)]  # min_tokens: the text's next token instead
            sequence.position += 1
        reason = sequence.take(token)
        if reason is not None:
            self._take(request_id).finish(reason)
        else:
            sequence.emit_new()

    def _take(self, request_id: str) -> _Sequence | None:
        """Removes a request from every queue; None when it already finished."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None and self._batch.pop(request_id, None) is None:
            self._waiting.remove(request_id)
        return sequence
