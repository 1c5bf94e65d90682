"""A response-sender thread that merges what queued up while it was busy, and sends a request's end first.

`ResponseSender.send` (and `is_cancelled`) is a round trip to the server process, made under
the stub's locks. Both decoupled models therefore send from one thread through an `Outbox`: the
producers (the engine's loop, the streaming model's workers) only queue, and the sender merges
the items one request queued since its last send. At low load every token still leaves alone
and at once; under load one response carries the tokens that arrived while the previous ones
were being sent, so the number of round trips stays what the server can take instead of the
streams falling further and further behind.

The sender takes what is queued after every send and answers the oldest waiting request next, except that a
request whose last item is waiting (`last`: its final response) goes first. Sent in arrival order, a request's end
waited behind one response for every other busy stream (hundreds of round trips under load), and a closed-loop
client only sends its next request once the last one ended: that wait, not the sending rate, was what streamed
throughput lost against whole answers (docs/performance.md, "A request's end sent first").

The same thread asks `tick` to run every `period` seconds (cancellation checks, gauges), so no other thread
talks to the server per token. The cancellation checks must stay on the sending thread: asked whether a request was
cancelled after its final response was sent, tritonserver 2.51 reads the freed response factory (a segfault in
TRITONBACKEND_ResponseFactoryIsCancelled).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def merge_runs(items: list[T], joinable: Callable[[T, T], bool], join: Callable[[list[T]], T]) -> list[T]:
    """One key's items with each run of consecutive joinable ones as one (`join` of the run), in order."""
    runs: list[list[T]] = []
    for item in items:
        if runs and joinable(runs[-1][-1], item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return [run[0] if len(run) == 1 else join(run) for run in runs]


class Outbox(Generic[T]):
    """`put(key, item)` from any thread; `send(key, item)` runs on the outbox's own thread, joined by key. `last(item)`
    says whether an item ends its key (a request's final response): a key with its end waiting is sent first."""

    def __init__(
        self,
        name: str,
        send: Callable[[object, T], None],
        joinable: Callable[[T, T], bool],
        join: Callable[[list[T]], T],
        last: Callable[[T], bool],
        tick: Callable[[], None],
        period: float,
        report: Callable[[str], None],
    ) -> None:
        self._send, self._joinable, self._join, self._last = send, joinable, join, last
        self._tick, self._period, self._report = tick, period, report
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # Keys with items not yet sent, by id, oldest first (an item of a key already waiting keeps its place).
        self._waiting: dict[int, tuple[object, list[T]]] = {}
        self._ending: dict[int, None] = {}  # those whose last item is among them, in the order it came
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, key: object, item: T) -> None:
        self._queue.put((key, item))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (a model being unloaded still owes its last responses), then stop."""
        self._running = False
        self._thread.join(timeout)

    def _gather(self) -> None:
        """Moves what is queued to the waiting keys; while none waits, first waits up to one period for an item."""
        try:
            item = self._queue.get_nowait() if self._waiting else self._queue.get(timeout=self._period)
            while True:
                key, value = item
                entry = self._waiting.get(id(key))
                if entry is None:
                    self._waiting[id(key)] = entry = (key, [])
                entry[1].append(value)
                if self._last(value):
                    self._ending[id(key)] = None
                item = self._queue.get_nowait()
        except queue.Empty:
            return

    def _next(self) -> tuple[object, list[T]]:
        """The key to send now, with its items: the first one whose end is waiting, else the oldest."""
        key_id = next(iter(self._ending)) if self._ending else next(iter(self._waiting))
        self._ending.pop(key_id, None)
        return self._waiting.pop(key_id)

    def _loop(self) -> None:
        next_tick = time.monotonic() + self._period
        while True:
            self._gather()
            if self._waiting:
                key, items = self._next()
                for item in merge_runs(items, self._joinable, self._join):
                    try:
                        self._send(key, item)
                    except Exception:  # one failed response must not stop the others
                        self._report("sending a response failed")
            elif not self._running:
                return
            if time.monotonic() >= next_tick:
                try:
                    self._tick()
                except Exception:
                    self._report("the sender's periodic check failed")
                next_tick = time.monotonic() + self._period
