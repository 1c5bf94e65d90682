"""Keep one thread doing torch's CPU work, so its OpenMP workers spin between operations instead of sleeping.

torch's CPU operations run on libgomp, which gives every thread that starts a parallel operation a team
of worker threads of its own, kept until that thread ends. libgomp lets idle workers spin for a while
before they sleep, which is what makes a chain of small operations (a small model's decode step) fast,
but once a process holds more OpenMP threads than CPUs it cuts that spinning to a few hundred
iterations (GOMP_SPINCOUNT and OMP_WAIT_POLICY do not lift this), and each operation then pays for
waking its workers. Loading a model on the caller's thread and generating on the batching manager's
leaves two teams, and a small host decodes much slower (docs/performance.md, "CPU: what each default is worth").

While it decodes, that one team keeps every core busy, and each step of the stream around it (the
engine's response sender, the streaming model's detokenizer, Triton's and the client's threads) woke
to wait for a core. With the team at a lower priority (`start_yielding`) they take one at once, so the
first streamed text comes sooner; the engine loses nothing when nothing else wants the
cores, but it yields to every other busy process of the host.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

# The niceness of a small host's engine threads: weight 110 against 1024, so a thread of normal priority that wakes
# takes a core from them at once.
YIELDING_NICENESS = 10


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


def start_yielding(start: Callable[[], None], niceness: int = YIELDING_NICENESS) -> None:
    """Calls `start` on a thread that ends, at `niceness` above the caller's nice value. Linux keeps nice
    values per thread and a new thread inherits its creator's, so the threads `start` starts (and the OpenMP
    teams they make) yield to the process's other threads and the host's other processes; the caller keeps
    its priority, which an unprivileged thread could not raise back."""

    def run() -> None:
        try:
            os.nice(niceness)
        except OSError as exc:  # e.g. a sandbox that forbids it: run at the same priority
            log.warning("could not lower the priority of the threads to start: %s", exc)
        start()

    on_fresh_thread(run)
