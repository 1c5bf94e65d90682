"""The OpenAI layer as a client of the engine's own process, as the engine model's instances are.

Where the engine runs in a process of its own (CUDA's default) on this host, a choice's engine request goes to that
process over its socket (tritonllm/link/engine_client.py), not over gRPC through tritonserver and the engine
model's stub: two hops less before the first token and for every token after it, with the engine model's rules,
admission and outputs. The engine's process is found by its server: the tritonserver listening on the layer's gRPC
port on this host (its process id is part of the socket's name). A server elsewhere, in another container or of
another user, a server restarted (a new process), or an engine in the engine model's process: the choice goes over
gRPC, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from tritonllm.errors import ErrorKind, TritonLLMError
from tritonllm.link.engine_client import EngineClient, client_for
from tritonllm.openai.errors import api_error
from tritonllm.openai.models import USAGE_PERF_OUTPUT
from tritonllm.protocol import PERF_OUTPUTS
from tritonllm.text.pipeline import Delta, StreamedRequest

LOOK_AGAIN_SECONDS = 5.0  # after no engine process was found: until then, choices go over gRPC
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0")


def listening_pid(port: int) -> int | None:
    """The process of this user's that listens on TCP `port` on this host (Linux's /proc), if any."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(entry.name)
    return None


def server_pid(grpc_url: str) -> int | None:
    """The tritonserver behind `grpc_url` when it runs on this host."""
    host, _, port = grpc_url.rpartition(":")
    if host not in LOCAL_HOSTS or not port.isdigit():
        return None
    pid = listening_pid(int(port))
    with contextlib.suppress(OSError):
        if pid is not None and b"tritonserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    return None


class _Emissions:
    """A choice's emissions, from the engine's reader thread to the event loop: one wake-up for all that came while
    the loop was busy (EngineClient.prepare's `emissions`), converted there, joined per generation."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list = []
        self._woken = asyncio.Event()
        self._pending = False

    def put(self, item) -> None:
        with self._lock:
            self._items.append(item)
            wake, self._pending = not self._pending, True
        if wake:
            self.loop.call_soon_threadsafe(self._woken.set)

    async def next_run(self) -> list:
        """What came since the last call, waiting for something."""
        await self._woken.wait()
        with self._lock:
            items, self._items, self._pending = self._items, [], False
            self._woken.clear()
        return items


class EngineProcessRoute:
    """The engine's process of the server behind `grpc_url`, for the engine model of `repository`, when there is one
    to reach."""

    def __init__(self, repository: Path, engine_model: str, grpc_url: str) -> None:
        self.repository, self.engine_model, self.grpc_url = repository, engine_model, grpc_url
        self._client: EngineClient | None = None
        self._looked_at = -LOOK_AGAIN_SECONDS
        self._in_process = False  # the build's engine runs in the engine model's process: never look

    def client(self) -> EngineClient | None:
        """The engine's process, or None: go over gRPC (looked for again at most every LOOK_AGAIN_SECONDS)."""
        if self._client is not None or self._in_process:
            return self._client
        now = time.monotonic()
        if now - self._looked_at < LOOK_AGAIN_SECONDS:
            return None
        self._looked_at = now
        pid = server_pid(self.grpc_url)
        if pid is None:
            return None
        self._client = client_for(self.repository, self.engine_model, pid)
        self._in_process = self._client is None
        return self._client

    def _lost(self, client: EngineClient) -> None:
        """No engine process answers for it (its server restarted, say): look again later."""
        if self._client is client:
            self._client = None
            client.close()

    async def deltas(self, client: EngineClient, pipeline: StreamedRequest) -> AsyncIterator[Delta]:
        """The choice's deltas from the engine's process; as the gRPC path, a stop string ends the engine's work and
        its final response's perf metrics are still awaited (into `pipeline.perf_metrics`)."""
        emissions = _Emissions(asyncio.get_running_loop())
        wanted = {n for n in pipeline.engine_outputs() if n not in PERF_OUTPUTS or n == USAGE_PERF_OUTPUT}
        try:
            stream = client.prepare(pipeline.engine_inputs(), wanted=wanted, emissions=emissions)
            stream.start()
        except TritonLLMError as exc:
            if exc.kind is ErrorKind.UNAVAILABLE:
                self._lost(client)
            raise api_error(exc.kind, str(exc)) from None
        pipeline.abort = stream.stop
        stopping, last = False, {}
        try:
            while not stream.done:
                items = await emissions.next_run()
                try:
                    for outputs in stream.convert(items):
                        last = outputs
                        if stopping:
                            continue
                        delta = pipeline.push(outputs)
                        if delta is not None:
                            yield delta
                        if pipeline.stopped:
                            stream.stop()
                            stopping = True
                except TritonLLMError as exc:
                    if not stopping:  # an error after the stop ends the choice: nothing more will come
                        raise api_error(exc.kind, str(exc)) from None
                    break
            if pipeline.perf:
                pipeline.perf_metrics = {name: last[name] for name in PERF_OUTPUTS if name in last}
        finally:
            pipeline.abort = None
            if not stream.done:  # the client went away: the engine's work ends now
                stream.stop()
            stream.close()
