"""torch work on a thread that ends leaves no OpenMP workers behind (tritonllm/engine/cpu_threads.py)."""

import os
import threading
import time

import pytest
import torch

from tritonllm.engine.cpu_threads import YIELDING_NICENESS, on_fresh_thread, start_yielding


def os_threads() -> set[str]:
    """The process's thread ids (other tests' threads may come and go meanwhile: compare sets, not counts)."""
    return set(os.listdir("/proc/self/task"))


def threads_added_since(before: set[str], within_s: float = 5.0) -> set[str]:
    """Threads that are not in `before`, once there are none or `within_s` has passed: a team's workers
    leave shortly after the thread that owned it."""
    deadline = time.monotonic() + within_s
    while (added := os_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return added


def parallel_work() -> float:
    a = torch.randn(512, 512)
    return float((a @ a).sum())  # large enough for torch to start its OpenMP team


def test_the_work_runs_elsewhere_and_its_result_or_error_comes_back():
    assert on_fresh_thread(threading.get_ident) != threading.get_ident()
    assert on_fresh_thread(lambda: 42) == 42
    with pytest.raises(ValueError, match="bad"):
        on_fresh_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))


def test_a_thread_that_ended_leaves_no_workers_where_a_live_one_does():
    before = os_threads()
    on_fresh_thread(parallel_work)
    assert threads_added_since(before) == set()  # its team ended with it
    if torch.get_num_threads() > 1:  # the control: a live thread that did the same keeps its workers
        done, release = threading.Event(), threading.Event()
        live = threading.Thread(target=lambda: (parallel_work(), done.set(), release.wait()))
        live.start()
        done.wait()
        assert len(os_threads() - before) >= 2  # the thread itself and at least one worker
        release.set()
        live.join()


def thread_nice(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)  # Linux: a thread id names one thread


def test_threads_started_yielding_run_at_a_lower_priority_and_the_caller_keeps_its_own():
    ours = thread_nice(threading.get_native_id())
    release = threading.Event()
    started = threading.Thread(target=release.wait)
    start_yielding(started.start)
    try:
        assert thread_nice(started.native_id) == min(ours + YIELDING_NICENESS, 19)
        assert thread_nice(threading.get_native_id()) == ours
    finally:
        release.set()
        started.join()
