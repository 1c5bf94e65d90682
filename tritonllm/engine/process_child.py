"""The engine's own process (`python -m tritonllm.engine.process_child FD PATH`): one engine for every engine-model
instance that connects to its socket (tritonllm/engine/process.py is the instances' side).

The process that starts it binds the socket and hands it over as file descriptor FD. The first connection
configures the engine; each later one must name the same configuration. Every connection sends requests one
message each and gets back, in one message per wake-up, what the engine emitted for its requests since the last
one, with the engine's load. When a connection ends (its instance closed it, or died), the engine drops that
connection's requests; when the last one ends, the process unlinks PATH and exits, so no orphan keeps the GPU's
memory. The exit is decided holding the lock that connecting instances hold, so none connects to an engine on its
way out.

Requests and their generation controls travel pickled, emissions as plain tuples of their fields; a parent checks
what this engine refuses by the `SubmitRules` it reports when ready. A guided request is answered ADMITTED or
REFUSED once its guide compiled. A client's `stop` request, which reaches one instance, is relayed to every
connection. The engine's metrics are reported by the first connection's instance alone, for the process's life, to
which the others' records are relayed: in tritonserver 2.51 a metric that two stubs register (same name and labels)
is one, freed when either stub drops it while the other still updates it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import operator
import os
import queue
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

from tritonllm.engine.api import BlockingGenerate, Emission, EngineConfig, GenerationRequest
from tritonllm.engine.synthetic import SyntheticConfig, SyntheticEngine
from tritonllm.errors import InputError, TritonLLMError
from tritonllm.protocol import FINISH_CANCELLED, FINISH_ERROR

LOAD_PERIOD = 0.2  # seconds between load reports while a connection's requests emit nothing; and the accept poll
CONFIG_SECONDS = 5.0  # a new connection's configuration must come within this, or it is closed
# Guided submits, whose guide may compile (up to the engine's deadline), run on this many threads: each instance
# hands over four at once (the engine model's GUIDED_SUBMITTERS); the engine bounds the compiles themselves.
GUIDED_SUBMITS = 16
# The protocol's messages, plain tuples whose first item is one of these: this module runs as __main__, whose
# classes the parent could not unpickle.
# From an instance: (CONFIG, config) first; then (SUBMIT, id, request), (CANCEL, id), (STOP, client request id),
# (RECORDS, pickled metrics records: this process does not import the model's modules), (CLOSE,).
CONFIG, SUBMIT, CANCEL, STOP, RECORDS, CLOSE = "config", "submit", "cancel", "stop", "records", "close"
# To an instance: (READY, SubmitRules, pid, reports metrics) or (FAILED, why); then (EMISSIONS, [(id, emission's
# fields or answer)], load, [relayed (STOP, ...) or (RECORDS, ...)]). Answers to a submit, told from an emission by
# their first item, a name where an emission has its token list: (ADMITTED,) when the engine queued a request the
# parent waits on (a guided one); (REFUSED, field, message) when its `submit` raised InputError.
READY, FAILED, EMISSIONS, ADMITTED, REFUSED = "ready", "failed", "emissions", "admitted", "refused"
# An emission's fields in order, as a tuple: a dataclass pickles several times slower (per emission of one token,
# 1.75 µs against 0.35 to convert and pickle; 1.13 against 0.48 to unpickle and rebuild), and a stream sends one
# per token; `Emission(*fields)` rebuilds it.
emission_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(Emission)))
REPORTER = 0  # the connection that reports the engine's metrics: the first, for the process's life

_CLOSED = object()  # a connection's outgoing queue: send what is queued, then stop


class Load(NamedTuple):
    """The child's load, sent to each connection with its emissions (at least every LOAD_PERIOD). It travels as a
    plain tuple: the child runs as `__main__`, where a class of its own does not unpickle."""

    in_batch: int = 0
    captured_graphs: int = 0
    steps: int | None = None  # the engine's finished steps: a stuck step stops the count, not the reports
    everyone: int = 0  # requests of every connection
    ours: int = 0  # this connection's
    others: int = 1  # open connections but this one, if it is closing
    alive: bool = True  # the engine's step loop runs: a failed step stops it while the child lives on


def lock_file(socket_path: Path) -> Path:
    """The lock beside a child's socket: an instance holds it from connecting until the child answered it (or, first,
    while it starts the child), and the child takes it to decide to exit."""
    return socket_path.with_suffix(".lock")


@contextlib.contextmanager
def socket_lock(socket_path: Path, wait: bool = True) -> Iterator[bool]:
    """`lock_file(socket_path)`, held exclusively (created if missing), released when the context ends or its holder
    dies; with `wait` False, the context gets False at once when another holds it. A holder may remove the file (the
    child does, on its way out, with its socket): whoever then gets the lock of the removed file tries the path again,
    so that two never hold locks on two files of one path."""
    path = lock_file(socket_path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            if _is_file_at(fd, path):
                break
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield True
    finally:
        os.close(fd)  # releases the lock


def _is_file_at(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def remove_socket(socket_path: Path) -> None:
    """A child's socket and its lock file, by the lock's holder. The socket first: once the lock's file is gone, a
    newcomer can lock a new one and would connect to the socket if it were still there."""
    socket_path.unlink(missing_ok=True)
    lock_file(socket_path).unlink(missing_ok=True)


Key = tuple[int, str]  # (connection, the instance's request id)


class _Requests:
    """Every connection's requests: their keys -> the engine's ids, while they run. `submit` holds no lock while the
    engine takes a request (and compiles its guide), so neither the engine's emissions nor other submits wait."""

    def __init__(self, engine: BlockingGenerate) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._live: dict[int, set[str]] = {}  # connection -> its requests from submit to their end
        self._engine_ids: dict[Key, str] = {}
        self._submitting: set[Key] = set()  # in the engine's `submit`
        self._ended: set[Key] = set()  # ended before `submit` returned their engine id
        self._cancelled: set[Key] = set()  # cancelled before it did

    def add_connection(self, conn: int) -> None:
        with self._lock:
            self._live[conn] = set()

    def load(self, conn: int) -> tuple[int, int]:
        """(requests of every connection, this connection's): the parents' admission counts the first."""
        with self._lock:
            return sum(map(len, self._live.values())), len(self._live.get(conn, ()))

    def receive(self, conn: int, request_id: str) -> bool:
        """A request as it arrives, before it waits for a submitter: a cancel from now on is kept for it. False when
        the connection closed meanwhile."""
        with self._lock:
            if conn not in self._live:
                return False
            self._live[conn].add(request_id)
            self._submitting.add((conn, request_id))
        return True

    def submit(self, conn: int, request_id: str, request: GenerationRequest, outgoing: queue.SimpleQueue) -> None:
        """A request received, to the engine: not one cancelled while it waited for a submitter (its connection
        closed, or its instance stopped waiting for its guide), which ends at once."""
        key = (conn, request_id)
        with self._lock:
            cancelled = key in self._cancelled
            if cancelled:
                self._submitting.discard(key)
                self._cancelled.discard(key)
                self._live.get(conn, set()).discard(request_id)
        if cancelled:
            outgoing.put((request_id, emission_fields(Emission([], FINISH_CANCELLED))))
            return
        try:
            engine_id = self.engine.submit(request, self._emitter(key, outgoing))
        except InputError as exc:
            outgoing.put((request_id, (REFUSED, exc.field, str(exc).removeprefix(f"{exc.field}: "))))
            engine_id = None
        except Exception as exc:  # its kind travels with it: the engine being full is not its failure
            kind = exc.kind if isinstance(exc, TritonLLMError) else None
            outgoing.put((request_id, emission_fields(Emission([], FINISH_ERROR, str(exc), error_kind=kind))))
            engine_id = None
        with self._lock:
            self._submitting.discard(key)
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
            if engine_id is None and key in self._submitting:
                self._cancelled.add(key)
        if engine_id is not None:
            self.engine.cancel(engine_id)

    def close(self, conn: int) -> None:
        """A connection's end: its requests are cancelled (those still in `submit` once they are in the engine)."""
        with self._lock:
            keys = [(conn, request_id) for request_id in self._live.pop(conn, set())]
            engine_ids = [self._engine_ids[key] for key in keys if key in self._engine_ids]
            self._cancelled.update(key for key in keys if key in self._submitting)
        for engine_id in engine_ids:
            self.engine.cancel(engine_id)

    def _emitter(self, key: Key, outgoing: queue.SimpleQueue) -> Callable[[Emission], None]:
        conn, request_id = key

        def emit(emission: Emission) -> None:
            if emission.final:
                with self._lock:
                    if self._engine_ids.pop(key, None) is None and key in self._submitting:
                        self._ended.add(key)
                    live = self._live.get(conn)
                    if live is not None:
                        live.discard(request_id)
            outgoing.put((request_id, emission_fields(emission)))

        return emit


class EngineServer:
    """The engine, and the connections of the instances it serves."""

    def __init__(self, engine: BlockingGenerate, config: object) -> None:
        self.engine = engine
        self.config = config
        self.requests = _Requests(engine)
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._outgoing: dict[int, queue.SimpleQueue] = {}  # open connections' queues
        self._threads: list[threading.Thread] = []
        self._guided = ThreadPoolExecutor(GUIDED_SUBMITS, thread_name_prefix="engine-guided")

    def connections(self) -> int:
        with self._lock:
            return len(self._outgoing)

    def admit(self, conn: Connection) -> None:
        """A connection whose configuration matched: answered READY, then served by a reader and a sender of its
        own."""
        number = next(self._numbers)
        conn.send((READY, self.engine.submit_rules, os.getpid(), number == REPORTER))
        outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self.requests.add_connection(number)
        with self._lock:
            self._outgoing[number] = outgoing
        for target, name in ((self._read, "reader"), (self._send_loop, "sender")):
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
            kind = message[0]
            if kind == SUBMIT:
                _, request_id, request = message
                if not self.requests.receive(number, request_id):
                    continue
                if request.guide is None:
                    self.requests.submit(number, request_id, request, outgoing)
                else:  # compiling a new grammar takes up to seconds: meanwhile this loop takes other requests
                    self._guided.submit(self.requests.submit, number, request_id, request, outgoing)
            elif kind == CANCEL:
                self.requests.cancel(number, message[1])
            elif kind == STOP:  # a client's stop request: every instance ends its calls that carry the id
                self._relay(message, None)
            elif kind == RECORDS:  # an instance's metrics records: the reporting instance counts them
                self._relay(message, REPORTER)
            elif kind == CLOSE:
                break
            else:
                print(f"engine process: connection {number} sent an unknown message {kind!r}", file=sys.stderr)
        with self._lock:
            self._outgoing.pop(number, None)  # first: nothing is relayed to it any more
        self.requests.close(number)
        outgoing.put(_CLOSED)

    def _relay(self, message: tuple, to: int | None) -> None:
        """To every open connection (`to` None), or to connection `to` if open (else it is dropped)."""
        with self._lock:
            queues = [q for n, q in self._outgoing.items() if to is None or n == to]
        for each in queues:
            each.put((None, message))

    def _send_loop(self, conn: Connection, number: int, outgoing: queue.SimpleQueue) -> None:
        """One message per wake-up: every emission queued for this connection since the last one, the messages of
        other connections relayed to it, and the Load."""
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
            engine = self.engine
            load = Load(
                engine.in_batch(),
                engine.captured_graphs(),
                engine.steps(),
                *self.requests.load(number),
                self.connections(),
                engine.alive(),
            )
            try:
                conn.send((EMISSIONS, emissions, tuple(load), relayed))
            except OSError:
                break  # the instance is gone; the reader sees it too
        conn.close()


def _read_config(conn: Connection, timeout: float | None = None) -> object:
    """A new connection's first message: the engine's configuration (EOFError when none comes in `timeout`)."""
    if timeout is not None and not conn.poll(timeout):
        raise EOFError
    kind, config = conn.recv()
    if kind != CONFIG:
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
        first.send((FAILED, "".join(traceback.format_exception_only(exc)).strip()))
        return 1
    server = EngineServer(engine, config)
    server.admit(first)
    listener.settimeout(LOAD_PERIOD)
    while True:
        try:
            accepted = listener.accept()[0]
        except TimeoutError:
            if not server.connections() and _stop_listening(path):
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
    it holds from connecting until this loop answered its configuration. The lock's file goes too: nothing is left
    in the folder once the last instance has left."""
    with socket_lock(path, wait=False) as held:
        if held:
            remove_socket(path)
        return held


def _welcome(server: EngineServer, conn: Connection) -> None:
    """A later connection: admitted if it names the engine's configuration; whatever it does wrong, it alone is
    closed."""
    try:
        config = _read_config(conn, CONFIG_SECONDS)
        if config == server.config:
            server.admit(conn)
            return
        conn.send((FAILED, "the engine's process serves another configuration"))
    except Exception as exc:  # gone, silent, or not speaking the protocol
        print(f"engine process: a connection failed before it was admitted: {exc!r}", file=sys.stderr)
    conn.close()


if __name__ == "__main__":
    bound = socket.socket(fileno=int(sys.argv[1]))
    code = serve(bound, Path(sys.argv[2]))
    sys.stdout.flush()
    os._exit(code)  # the engine's threads are stopped or daemons: do not wait on torch's own at exit
