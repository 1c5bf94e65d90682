"""The engine's own process (`python -m tritonllm.engine.process_child FD PATH`): one engine for every engine-model
instance that connects to its socket (tritonllm/engine/process.py is the instances' side).

The process that starts it binds the socket and hands it over as file descriptor FD. The first connection
configures the engine; each later one must name the same configuration. Every connection sends requests one
message each and gets back, in one message per wake-up, what the engine emitted for its requests since the last
one, with the engine's load. When a connection ends (its instance closed it, or died), the engine drops that
connection's requests; when the last one ends, the process unlinks PATH and exits, so no orphan keeps the GPU's
memory. The exit is decided holding the lock that connecting instances hold, so none connects to an engine on its
way out.

Requests, emissions and their generation controls travel pickled; a parent checks what this engine refuses by the
`SubmitRules` it reports when ready. A guided request is answered ADMITTED or REFUSED once its guide compiled. A
client's `stop` request, which reaches one instance, is relayed to every connection; the engine's metrics are
reported by one instance (tritonserver 2.51 frees a metric twice that two stubs registered), to which the others'
records are relayed.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import queue
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

from tritonllm.engine.api import BlockingGenerate, Emission, EngineConfig, GenerationRequest
from tritonllm.engine.synthetic import SyntheticConfig, SyntheticEngine
from tritonllm.errors import InputError
from tritonllm.protocol import FINISH_ERROR

LOAD_PERIOD = 0.2  # seconds between load reports while a connection's requests emit nothing; and the accept poll
# Answers to a submit, sent among a connection's emissions as plain tuples: ("admitted",) when the engine queued a
# request the parent waits on (a guided one); ("refused", field, message) when its engine's `submit` raised
# InputError. Plain tuples, because this module runs as __main__, whose classes the parent could not unpickle.
ADMITTED = "admitted"
REFUSED = "refused"
# Messages of one connection that the child relays: a client's stop request (its request id) to every connection;
# metrics records (pickled by the sender: this process does not import the model's modules) to the reporting one.
STOP = "stop"
RECORDS = "records"

_CLOSED = object()  # a connection's outgoing queue: send what is queued, then the close answer, then stop


@contextlib.contextmanager
def lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive lock on `path` (created if missing), released when the context ends or its holder dies; with
    `wait` False, the context gets False at once when another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)  # releases the lock


class _Requests:
    """Every connection's requests: (connection, the parent's id) -> the engine's id, while they run. `submit` holds
    no lock while the engine takes a request (and compiles its guide), so neither the engine's emissions nor other
    submits wait."""

    def __init__(self, engine: BlockingGenerate) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._live: dict[int, set[str]] = {}  # connection -> its requests from submit to their end
        self._engine_ids: dict[tuple[int, str], str] = {}
        self._ended: set[tuple[int, str]] = set()  # ended before `submit` returned their engine id
        self._cancelled: set[tuple[int, str]] = set()  # cancelled before it did

    def open(self, conn: int) -> None:
        with self._lock:
            self._live[conn] = set()

    def load(self, conn: int) -> tuple[int, int]:
        """(requests of every connection, this connection's): the parents' admission counts the first."""
        with self._lock:
            return sum(map(len, self._live.values())), len(self._live.get(conn, ()))

    def submit(self, conn: int, request_id: str, request: GenerationRequest, outgoing: queue.SimpleQueue) -> None:
        key = (conn, request_id)
        with self._lock:
            if conn not in self._live:
                return  # the connection closed meanwhile
            self._live[conn].add(request_id)
        try:
            engine_id = self.engine.submit(request, self._emitter(key, outgoing))
        except InputError as exc:
            outgoing.put((request_id, (REFUSED, exc.field, str(exc).removeprefix(f"{exc.field}: "))))
            engine_id = None
        except Exception as exc:
            outgoing.put((request_id, Emission([], FINISH_ERROR, str(exc))))
            engine_id = None
        with self._lock:
            ended = key in self._ended or engine_id is None
            cancelled = key in self._cancelled
            self._ended.discard(key)
            self._cancelled.discard(key)
            if ended:
                self._live.get(conn, set()).discard(request_id)
            else:
                self._engine_ids[key] = engine_id
        if engine_id is None:
            return
        if request.guide is not None:
            outgoing.put((request_id, (ADMITTED,)))
        if cancelled and not ended:
            self.engine.cancel(engine_id)

    def cancel(self, conn: int, request_id: str) -> None:
        key = (conn, request_id)
        with self._lock:
            engine_id = self._engine_ids.get(key)
            if engine_id is None and request_id in self._live.get(conn, ()):
                self._cancelled.add(key)  # still in the engine's `submit`
        if engine_id is not None:
            self.engine.cancel(engine_id)

    def close(self, conn: int) -> None:
        """A connection's end: its requests are cancelled (those still in `submit` once they are in the engine)."""
        with self._lock:
            request_ids = self._live.pop(conn, set())
            keys = [(conn, request_id) for request_id in request_ids]
            engine_ids = [self._engine_ids[key] for key in keys if key in self._engine_ids]
            self._cancelled.update(key for key in keys if key not in self._engine_ids)
        for engine_id in engine_ids:
            self.engine.cancel(engine_id)

    def _emitter(self, key: tuple[int, str], outgoing: queue.SimpleQueue) -> Callable[[Emission], None]:
        conn, request_id = key

        def emit(emission: Emission) -> None:
            if emission.final:
                with self._lock:
                    if self._engine_ids.pop(key, None) is None:
                        self._ended.add(key)  # still in `submit`
                    live = self._live.get(conn)
                    if live is not None:
                        live.discard(request_id)
            outgoing.put((request_id, emission))

        return emit


class EngineServer:
    """The engine, and the connections of the instances it serves."""

    def __init__(self, engine: BlockingGenerate, config: object) -> None:
        self.engine = engine
        self.config = config
        self.requests = _Requests(engine)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._outgoing: dict[int, queue.SimpleQueue] = {}  # open connections' queues
        self._threads: list[threading.Thread] = []

    def open(self) -> int:
        with self._lock:
            return len(self._outgoing)

    def serve(self, conn: Connection) -> None:
        """A connection whose configuration the caller answered: its reader and its sender, on threads of their own."""
        number = next(self._ids)
        outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self.requests.open(number)
        with self._lock:
            self._outgoing[number] = outgoing
        for target, name in ((self._read, "reader"), (self._send, "sender")):
            thread = threading.Thread(target=target, args=(conn, number, outgoing), name=f"engine-{name}-{number}")
            thread.start()
            self._threads.append(thread)

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def _read(self, conn: Connection, number: int, outgoing: queue.SimpleQueue) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # the instance is gone
            if message[0] == "submit":
                _, request_id, request = message
                if request.guide is None:
                    self.requests.submit(number, request_id, request, outgoing)
                else:  # compiling a new grammar takes up to seconds: meanwhile this loop takes other requests
                    args = (number, request_id, request, outgoing)
                    threading.Thread(target=self.requests.submit, args=args, daemon=True).start()
            elif message[0] == "cancel":
                self.requests.cancel(number, message[1])
            elif message[0] == STOP:  # a client's stop request: every instance ends its calls that carry the id
                self._relay(message, everyone=True)
            elif message[0] == RECORDS:  # an instance's metrics records: the reporting instance counts them
                self._relay(message, everyone=False)
            elif message[0] == "close":
                break
        self.requests.close(number)
        with self._lock:
            self._outgoing.pop(number, None)
        outgoing.put(_CLOSED)

    def _relay(self, message: tuple, everyone: bool) -> None:
        with self._lock:
            numbers = sorted(self._outgoing)[: None if everyone else 1]
            queues = [self._outgoing[n] for n in numbers]
        for each in queues:
            each.put((None, message))

    def _connections(self, number: int) -> tuple[int, bool]:
        """How many connections are open, and whether `number` reports the metrics: the oldest open one."""
        with self._lock:
            return len(self._outgoing), bool(self._outgoing) and number == min(self._outgoing)

    def _send(self, conn: Connection, number: int, outgoing: queue.SimpleQueue) -> None:
        """One message per wake-up: every emission queued for this connection since the last one, the messages of
        other connections relayed to it, and the load: (in batch, CUDA graphs, requests of all connections, this
        connection's, connections, whether this one reports the metrics)."""
        closed = False
        while not closed:
            try:
                items = [outgoing.get(timeout=LOAD_PERIOD)]
            except queue.Empty:
                items = []
            while True:
                try:
                    items.append(outgoing.get_nowait())
                except queue.Empty:
                    break
            closed = _CLOSED in items
            emissions = [i for i in items if i is not _CLOSED and i[0] is not None]
            relayed = [i[1] for i in items if i is not _CLOSED and i[0] is None]
            engine = (self.engine.in_batch(), self.engine.captured_graphs())
            load = (*engine, *self.requests.load(number), *self._connections(number))
            try:
                conn.send(("emissions", emissions, load, relayed))
            except OSError:
                break  # the instance is gone; the reader sees it too
        conn.close()


def _read_config(conn: Connection) -> object:
    """A new connection's first message: the engine's configuration."""
    kind, config = conn.recv()
    if kind != "config":
        raise ValueError(f"a connection's first message must be its configuration, not {kind!r}")
    return config


def serve(
    listener: socket.socket,
    path: Path,
    make_engine: Callable[[EngineConfig | SyntheticConfig], BlockingGenerate] | None = None,
) -> int:
    """Runs the engine the first connection configures (PortableEngine, or the synthetic benchmark engine for its
    configuration, unless `make_engine` says otherwise) until its last connection ends."""
    first = Connection(listener.accept()[0].detach())
    config = _read_config(first)
    if make_engine is None and isinstance(config, SyntheticConfig):
        make_engine = SyntheticEngine
    elif make_engine is None:
        from tritonllm.engine.portable import PortableEngine as make_engine  # torch: only this process loads it
    try:
        engine = make_engine(config)
    except BaseException as exc:
        traceback.print_exc()  # into the server's log; the parent's error names the exception
        path.unlink(missing_ok=True)  # the starting instance holds the lock: nobody else is connecting
        first.send(("failed", "".join(traceback.format_exception_only(exc)).strip()))
        return 1
    server = EngineServer(engine, config)
    first.send(("ready", engine.submit_rules))
    server.serve(first)
    listener.settimeout(LOAD_PERIOD)
    while True:
        try:
            accepted = listener.accept()[0]
        except TimeoutError:
            if not server.open() and _stop_listening(path):
                break
            continue
        accepted.setblocking(True)
        _welcome(server, Connection(accepted.detach()))
    listener.close()
    engine.shutdown()  # fails what is still running
    server.join()
    return 0


def _stop_listening(path: Path) -> bool:
    """Whether the socket was removed, so that no instance connects any more: not while one holds the lock, which
    it holds from connecting until this loop answered its configuration."""
    with lock(path.with_suffix(".lock"), wait=False) as held:
        if held:
            path.unlink(missing_ok=True)
        return held


def _welcome(server: EngineServer, conn: Connection) -> None:
    try:
        config = _read_config(conn)
    except (EOFError, OSError, ValueError):
        conn.close()
        return
    if config != server.config:
        conn.send(("failed", "the engine's process serves another configuration"))
        conn.close()
        return
    conn.send(("ready", server.engine.submit_rules))
    server.serve(conn)


if __name__ == "__main__":
    bound = socket.socket(fileno=int(sys.argv[1]))
    code = serve(bound, Path(sys.argv[2]))
    sys.stdout.flush()
    os._exit(code)  # the engine's threads are stopped or daemons: do not wait on torch's own at exit
