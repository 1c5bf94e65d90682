"""The portable engine (or the synthetic benchmark engine) in a process of its own, as vLLM's engine core runs apart
from its API server.

In one process, a single interpreter lock carries both the generation loop (transformers' host work
for every step of every request) and the engine model's response sender (a Triton response per token
per stream): under a heavy load on a GPU the stub's one core bounds the served streams below the same
engine in-process (docs/performance.md, "The engine in its own process"). With
`EngineProcess` the stub parses requests and sends responses while a child process
(`python -m tritonllm.engine.process FD`) runs `PortableEngine`; requests go to it one message each,
and it sends back everything its engine emitted since its previous message in one message.

The child ends when its connection does: when the stub stops, or dies, the socket closes and the
child exits, so no orphan keeps the GPU's memory.

Requests, emissions and their generation controls travel pickled. The stub refuses what the child's engine
would, by the engine's `SubmitRules`, which the child reports when it is ready; a guide only the child can
compile, so `submit` waits for the child's answer to a guided request.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from tritonllm.engine.api import BlockingGenerate, Emission, EngineConfig, GenerationRequest, SubmitRules
from tritonllm.engine.checks import check_submit
from tritonllm.engine.synthetic import SyntheticConfig, SyntheticEngine
from tritonllm.errors import EngineFailure, InputError
from tritonllm.protocol import FINISH_ERROR

LOAD_PERIOD = 0.2  # seconds between the child's load reports while it emits nothing


class EngineProcessError(EngineFailure):
    """The engine's process failed to start, or ended."""


# The child's answers to a submit, sent among its emissions as plain tuples (the child runs this module as
# __main__, whose classes the parent could not unpickle): ("admitted",) when its engine queued a request the parent
# waits on (a guided one); ("refused", field, message) when its engine's `submit` raised InputError.
ADMITTED = "admitted"
REFUSED = "refused"


class _Admission:
    """A parent's `submit` waiting for the child's answer."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer: tuple = ()  # empty: the request ended (or the child did) before an answer


class EngineProcess(BlockingGenerate):
    """`PortableEngine`'s interface, served by a child process (the synthetic engine, for its configuration). `emit`
    callbacks run on this process's reader thread, in the order the child's engine made the emissions."""

    def __init__(self, config: EngineConfig | SyntheticConfig) -> None:
        here, there = socket.socketpair()
        self._conn = Connection(here.detach())
        # In a stub, sys.executable is the server environment's python, whose packages the stub imports.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tritonllm.engine.process", str(there.fileno())], pass_fds=[there.fileno()]
        )
        there.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._emits: dict[str, Callable[[Emission], None]] = {}
        self._ids = itertools.count()
        self._load = (0, 0)  # the child's latest (requests in the batch, CUDA graphs held)
        self._ended: str | None = None  # why the child is gone, once it is
        self._admissions: dict[str, _Admission] = {}
        self._send(("config", config))
        try:
            answer = self._conn.recv()
        except (EOFError, OSError):
            answer = ("failed", f"it exited with code {self._process.wait()} before it was ready")
        if answer[0] != "ready":
            self._process.wait()
            raise EngineProcessError(f"the engine's process failed to start: {answer[1]}")
        self.submit_rules: SubmitRules = answer[1]  # what the child's engine refuses, checked here: a 400 at once
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ PortableEngine's interface

    def submit(self, request: GenerationRequest, emit: Callable[[Emission], None]) -> str:
        check_submit(request, self.submit_rules)
        request_id = f"p{next(self._ids)}"
        admission = _Admission() if request.guide is not None else None
        with self._lock:
            ended = self._ended
            if ended is None:
                self._emits[request_id] = emit
                if admission is not None:
                    self._admissions[request_id] = admission
        if ended is not None:
            emit(Emission([], FINISH_ERROR, ended))
            return request_id
        self._send(("submit", request_id, request))
        if admission is not None:
            admission.done.wait()  # the child compiles the guide, or its end fails the request
            if admission.answer[:1] == (REFUSED,):
                with self._lock:
                    self._emits.pop(request_id, None)
                raise InputError(*admission.answer[1:])
        return request_id

    def cancel(self, request_id: str) -> None:
        with self._lock:
            live = request_id in self._emits
        if live:
            self._send(("cancel", request_id))

    def running(self) -> int:
        with self._lock:
            return len(self._emits)

    def in_batch(self) -> int:
        return self._load[0]

    def captured_graphs(self) -> int:
        return self._load[1]

    def alive(self) -> bool:
        return self._ended is None

    def shutdown(self, timeout: float = 30.0) -> None:
        """The child's engine fails what is still running (as PortableEngine.shutdown does), then it exits."""
        self._send(("stop",))
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=5)
        self._conn.close()

    # ------------------------------------------------------------------ the connection

    def _send(self, message: tuple) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # a child that is gone: the reader fails its requests
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                _, emissions, self._load = self._conn.recv()
            except (EOFError, OSError):
                break
            for request_id, emission in emissions:
                if not isinstance(emission, Emission):
                    self._answered(request_id, emission)
                    continue
                with self._lock:
                    emit = self._emits.pop(request_id) if emission.final else self._emits.get(request_id)
                    admission = self._admissions.pop(request_id, None) if emission.final else None
                if emit is not None:
                    emit(emission)
                if admission is not None:  # it failed in the child's submit: `emit` has its error
                    admission.done.set()
        code = self._process.wait()
        reason = "the engine's process has stopped" if code == 0 else f"the engine's process exited with code {code}"
        with self._lock:
            self._ended = reason
            pending = list(self._emits.values())
            self._emits.clear()
            waiting = list(self._admissions.values())
            self._admissions.clear()
        for admission in waiting:
            admission.done.set()
        for emit in pending:
            emit(Emission([], FINISH_ERROR, reason))

    def _answered(self, request_id: str, answer: tuple) -> None:
        """The child's answer to a submit: to the `submit` waiting on it, or, refused when none waits (the parent
        checks what the child would refuse), to the request as an error."""
        refused = answer[0] == REFUSED
        with self._lock:
            admission = self._admissions.pop(request_id, None)
            emit = self._emits.pop(request_id, None) if admission is None and refused else None
        if admission is not None:
            admission.answer = answer
            admission.done.set()
        elif emit is not None:
            emit(Emission([], FINISH_ERROR, f"{answer[1]}: {answer[2]}"))


# ---------------------------------------------------------------------- the child


def serve_child(
    conn: Connection, make_engine: Callable[[EngineConfig | SyntheticConfig], BlockingGenerate] | None = None
) -> int:
    """Runs the engine the first message configures (PortableEngine, or the synthetic benchmark engine for its
    configuration, unless `make_engine` says otherwise), until the connection ends or asks it to stop."""
    _, config = conn.recv()
    if make_engine is None and isinstance(config, SyntheticConfig):
        make_engine = SyntheticEngine
    elif make_engine is None:
        from tritonllm.engine.portable import PortableEngine as make_engine  # torch: only this process loads it
    try:
        engine = make_engine(config)
    except BaseException as exc:
        traceback.print_exc()  # into the server's log; the parent's error names the exception
        conn.send(("failed", "".join(traceback.format_exception_only(exc)).strip()))
        return 1
    outgoing: queue.SimpleQueue = queue.SimpleQueue()
    requests = _Requests(engine, outgoing)
    sender = threading.Thread(target=_send_emissions, args=(conn, outgoing, engine), name="engine-process-sender")
    conn.send(("ready", engine.submit_rules))
    sender.start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        if message[0] == "submit":
            _, request_id, request = message
            if request.guide is None:
                requests.submit(request_id, request)
            else:  # compiling a new grammar takes up to seconds: meanwhile this loop takes other requests
                threading.Thread(target=requests.submit, args=(request_id, request), daemon=True).start()
        elif message[0] == "cancel":
            requests.cancel(message[1])
        elif message[0] == "stop":
            break
    engine.shutdown()
    outgoing.put(None)
    sender.join()
    return 0


class _Requests:
    """The child's requests: the parent's ids -> the engine's, while they run. `submit` holds no lock while the
    engine takes a request (and compiles its guide), so neither the engine's emissions nor other submits wait."""

    def __init__(self, engine: BlockingGenerate, outgoing: queue.SimpleQueue) -> None:
        self.engine = engine
        self.outgoing = outgoing
        self._lock = threading.Lock()
        self._engine_ids: dict[str, str] = {}
        self._submitting: set[str] = set()
        self._ended: set[str] = set()  # ended before `submit` returned their engine id
        self._cancelled: set[str] = set()  # cancelled before it did

    def submit(self, request_id: str, request: GenerationRequest) -> None:
        with self._lock:
            self._submitting.add(request_id)
        try:
            engine_id = self.engine.submit(request, self._emitter(request_id))
        except InputError as exc:
            self.outgoing.put((request_id, (REFUSED, exc.field, str(exc).removeprefix(f"{exc.field}: "))))
            engine_id = None
        except Exception as exc:
            self.outgoing.put((request_id, Emission([], FINISH_ERROR, str(exc))))
            engine_id = None
        with self._lock:
            self._submitting.discard(request_id)
            ended = request_id in self._ended
            cancelled = request_id in self._cancelled
            self._ended.discard(request_id)
            self._cancelled.discard(request_id)
            if engine_id is not None and not ended:
                self._engine_ids[request_id] = engine_id
        if engine_id is None:
            return
        if request.guide is not None:
            self.outgoing.put((request_id, (ADMITTED,)))
        if cancelled and not ended:
            self.engine.cancel(engine_id)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            engine_id = self._engine_ids.get(request_id)
            if engine_id is None and request_id in self._submitting:
                self._cancelled.add(request_id)
        if engine_id is not None:
            self.engine.cancel(engine_id)

    def _emitter(self, request_id: str) -> Callable[[Emission], None]:
        def emit(emission: Emission) -> None:
            if emission.final:
                with self._lock:
                    if self._engine_ids.pop(request_id, None) is None and request_id in self._submitting:
                        self._ended.add(request_id)
            self.outgoing.put((request_id, emission))

        return emit


def _send_emissions(conn: Connection, outgoing: queue.SimpleQueue, engine) -> None:
    """One message per wake-up: every emission queued since the last one, and the engine's load."""
    done = False
    while not done:
        try:
            items = [outgoing.get(timeout=LOAD_PERIOD)]
        except queue.Empty:
            items = []
        while True:
            try:
                items.append(outgoing.get_nowait())
            except queue.Empty:
                break
        done = None in items
        try:
            conn.send(("emissions", [i for i in items if i is not None], (engine.in_batch(), engine.captured_graphs())))
        except OSError:
            return  # the parent is gone; the main loop sees it too


if __name__ == "__main__":
    connection = Connection(int(sys.argv[1]))
    code = serve_child(connection)
    connection.close()
    sys.stdout.flush()
    os._exit(code)  # the engine's threads are stopped or daemons: do not wait on torch's own at exit
