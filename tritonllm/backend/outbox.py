"""A response-sender thread that merges what queued up while it was busy.

`ResponseSender.send` (and `is_cancelled`) is a round trip to the server process, made under
the stub's locks. Both decoupled models therefore send from one thread through an `Outbox`: the
producers (the engine's loop, the streaming model's workers) only queue, and the sender merges
the items one request queued since its last send. At low load every token still leaves alone
and at once; under load one response carries the tokens that arrived while the previous ones
were being sent, so the number of round trips stays what the server can take instead of the
streams falling further and further behind. The same thread asks `tick` to run every `period`
seconds (cancellation checks, gauges), so no other thread talks to the server per token. The cancellation
checks must stay on the sending thread: asked whether a request was cancelled after its final response was
sent, tritonserver 2.51 reads the freed response factory (a segfault in TRITONBACKEND_ResponseFactoryIsCancelled).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def coalesce(
    items: list[tuple[object, T]], joinable: Callable[[T, T], bool], join: Callable[[list[T]], T]
) -> list[tuple[object, T]]:
    """Each key's consecutive joinable items as one (`join` of the run); keys keep their first position."""
    runs: list[tuple[object, list[T]]] = []
    latest: dict[int, list[T]] = {}  # id(key) -> the key's latest run
    for key, item in items:
        run = latest.get(id(key))
        if run is not None and joinable(run[-1], item):
            run.append(item)
        else:
            latest[id(key)] = run = [item]
            runs.append((key, run))
    return [(key, run[0] if len(run) == 1 else join(run)) for key, run in runs]


class Outbox(Generic[T]):
    """`put(key, item)` from any thread; `send(key, item)` runs on the outbox's own thread, joined by key."""

    def __init__(
        self,
        name: str,
        send: Callable[[object, T], None],
        joinable: Callable[[T, T], bool],
        join: Callable[[list[T]], T],
        tick: Callable[[], None],
        period: float,
        report: Callable[[str], None],
    ) -> None:
        self._send, self._joinable, self._join = send, joinable, join
        self._tick, self._period, self._report = tick, period, report
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, key: object, item: T) -> None:
        self._queue.put((key, item))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (a model being unloaded still owes its last responses), then stop."""
        self._running = False
        self._thread.join(timeout)

    def _take(self) -> list[tuple[object, T]]:
        """What is queued, waiting up to one period for the first item."""
        try:
            items = [self._queue.get(timeout=self._period)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def _loop(self) -> None:
        next_tick = time.monotonic() + self._period
        while True:
            items = self._take()
            for key, item in coalesce(items, self._joinable, self._join):
                try:
                    self._send(key, item)
                except Exception:  # one failed response must not stop the others
                    self._report("sending a response failed")
            if not self._running and not items:
                return
            if time.monotonic() >= next_tick:
                try:
                    self._tick()
                except Exception:
                    self._report("the sender's periodic check failed")
                next_tick = time.monotonic() + self._period
