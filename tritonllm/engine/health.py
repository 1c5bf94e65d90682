"""The engine's health, as the watchdog's and Kubernetes' liveness probe asks it (tritonllm.launch.tritonserver.
probe_engine): a loop that runs is not enough. A wedged step (a hung llama_decode, a CUDA step that never returns
in the engine's process) leaves every thread alive while every request hangs, so a busy engine must show a step
finished within STALLED_STEP_SECONDS; an idle one whose health is unknown generates one token, as TGI's health
check does, so that a broken model is found before a user's request meets it.
"""

from __future__ import annotations

import threading
import time

from tritonllm.engine.api import BlockingGenerate, Emission, GenerationRequest

# No engine step takes this long where the project runs (a step is one decode, or one chunk of prompts); a larger
# model on a CPU makes slow steps, not none.
STALLED_STEP_SECONDS = 300.0
PROBE_GENERATION_SECONDS = 10.0  # an idle engine's one-token generation: it waits for nothing but the model


class EngineHealth:
    """Answers the probe for one engine. The stall clock starts when the probe first sees the engine busy at a step
    count (read lazily: nothing runs between probes), so a request arriving after a long idle is not a stall."""

    def __init__(
        self,
        engine: BlockingGenerate,
        stalled_after: float = STALLED_STEP_SECONDS,
        generation_timeout: float = PROBE_GENERATION_SECONDS,
    ) -> None:
        self.engine = engine
        self.stalled_after = stalled_after
        self.generation_timeout = generation_timeout
        self._busy_at: tuple[int, float] | None = None  # (steps, when the probe first saw that count while busy)
        self._known_good_at: int | None = None  # the step count at which the engine last proved it generates
        self._lock = threading.Lock()  # probes may come to several threads of one instance

    def problem(self) -> str | None:
        """None when the engine is healthy; else why not, for the probe's error."""
        engine = self.engine
        if not engine.alive():
            return "the engine's generation loop has stopped"
        with self._lock:
            steps, running = engine.steps(), engine.running()
            if running:
                return self._stalled(steps, running)
            self._busy_at = None
            if steps is not None and steps == self._known_good_at:
                return None  # no step since it last generated: nothing new to learn from another token
            problem = self._generate_one()
            self._known_good_at = engine.steps() if problem is None else None
            return problem

    def _stalled(self, steps: int | None, running: int) -> str | None:
        if steps is None:  # an engine that cannot count its steps (the LLM API's): its loop's life is all it shows
            return None
        now = time.monotonic()
        if self._busy_at is None or self._busy_at[0] != steps:
            self._busy_at = (steps, now)
            return None
        waited = now - self._busy_at[1]
        if waited <= self.stalled_after:
            return None
        return (
            f"the engine has finished no step in {waited:.0f} s with {running} requests in it "
            f"(the limit is {self.stalled_after:.0f} s): its step is stuck"
        )

    def _generate_one(self) -> str | None:
        """One token of a one-token prompt, directly in the engine (no admission, no metrics)."""
        done = threading.Event()
        final: list[Emission] = []

        def emit(emission: Emission) -> None:
            if emission.final:
                final.append(emission)
                done.set()

        try:
            request_id = self.engine.submit(GenerationRequest([0], 1), emit)
        except Exception as exc:
            return f"the engine refused the probe's one-token generation: {exc}"
        if not done.wait(self.generation_timeout):
            self.engine.cancel(request_id)
            return f"the engine generated no token for the probe in {self.generation_timeout:.0f} s while idle"
        if final[0].error:
            return f"the probe's one-token generation failed: {final[0].error}"
        return None
