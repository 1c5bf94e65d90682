"""The text-facing models' admission: a Python-backend model that forwards to the engine model holds a worker thread
per request for its whole life. A plain pool's queue has no bound, so past its threads requests waited there with a
latency that only grew and never a refusal; here a request past them is refused at once as busy (HTTP 429, gRPC
UNAVAILABLE), as the engine model refuses past its queue, so that a client or a load balancer can go elsewhere."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tritonllm.errors import ServerBusy


class BoundedWorkers:
    """At most `limit` requests at once, each on a thread of its own; `submit` refuses more with ServerBusy."""

    def __init__(self, limit: int, model: str) -> None:
        self.limit = limit
        self.model = model
        self._pool = ThreadPoolExecutor(limit, thread_name_prefix=model)
        self._taken = 0
        self._lock = threading.Lock()

    def submit(self, function: Callable, *args) -> None:
        with self._lock:
            if self._taken >= self.limit:
                raise ServerBusy(
                    f"server busy: {self.model} has {self._taken} requests in flight and its limit is {self.limit} "
                    "(max_inflight_requests); retry later"
                )
            self._taken += 1
        self._pool.submit(function, *args).add_done_callback(self._done)

    def in_flight(self) -> int:
        return self._taken

    def _done(self, _: Future) -> None:
        with self._lock:
            self._taken -= 1

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
