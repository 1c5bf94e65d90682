"""Keep one thread doing torch's CPU work, so its OpenMP workers spin between operations instead of sleeping.

torch's CPU operations run on libgomp, which gives every thread that starts a parallel operation a team
of worker threads of its own, kept until that thread ends. libgomp lets idle workers spin for a while
before they sleep, which is what makes a chain of small operations (a small model's decode step) fast,
but once a process holds more OpenMP threads than CPUs it cuts that spinning to a few hundred
iterations (GOMP_SPINCOUNT and OMP_WAIT_POLICY do not lift this), and each operation then pays for
waking its workers. Loading a model on the caller's thread and generating on the batching manager's
leaves two teams: on a 2-core host SmolLM2 decoded at ~16 tokens/s instead of ~24 (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_fresh_thread(work: Callable[[], T]) -> T:
    """Runs `work` on a new thread and returns its result (or raises its exception) once that thread has
    ended, so the OpenMP team its torch operations made is gone with it."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # handed to the caller, raised there
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="torch-setup")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
