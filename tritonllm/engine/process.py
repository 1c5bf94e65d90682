"""The portable engine (or the synthetic benchmark engine) in a process of its own, as vLLM's engine core runs apart
from its API servers, which the engine model's instances share (--engine-instances).

In one process, a single interpreter lock carries both the generation loop (transformers' host work
for every step of every request) and the engine model's response sender (a Triton response per token
per stream): under a heavy load on a GPU the stub's one core bounds the served streams below the same
engine in-process (docs/performance.md, "The engine in its own process"). With
`EngineProcess` the stub parses requests and sends responses while a child process
(tritonllm/engine/process_child.py) runs `PortableEngine`; requests go to it one message each,
and it sends back everything its engine emitted since its previous message in one message. Several instances
of the engine model, each a process with its own interpreter lock, connect to the same child: the responses of
one engine are sent by several senders.

Instances that name the same `shared_as` and configuration share one child: it listens on a Unix socket in a
folder only this user may enter, and the first instance to find no child there starts it, holding a lock file
beside the socket that the others wait on. The child ends when its last connection does: when the instances
stop, or die, the sockets close and the child exits, so no orphan keeps the GPU's memory.

Requests and their generation controls travel pickled, emissions as tuples of their fields. The stub refuses
what the child's engine would, by the engine's `SubmitRules`, which the child reports when it is ready; a
guide only the child can compile, so `submit` waits for the child's answer to a guided request (up to
GUIDE_COMPILE_SECONDS).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import pickle
import secrets
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NoReturn

from tritonllm.engine.api import BlockingGenerate, Emission, EngineConfig, GenerationRequest, SubmitRules
from tritonllm.engine.checks import check_submit
from tritonllm.engine.grammar_check import GUIDE_COMPILE_SECONDS, compile_too_slow
from tritonllm.engine.process_child import (
    CANCEL,
    CLOSE,
    CONFIG,
    FAILED,
    READY,
    RECORDS,
    REFUSED,
    STOP,
    SUBMIT,
    Load,
    lock_file,
    remove_socket,
    socket_lock,
)
from tritonllm.engine.synthetic import SyntheticConfig
from tritonllm.errors import EngineFailure, ErrorKind, InputError
from tritonllm.protocol import FINISH_ERROR

SHUTDOWN_REASON = "the engine is shutting down"  # as the engines' own shutdown says it
MAX_SOCKET_PATH = 100  # bytes: a Unix socket's path must fit in 108, with its terminating zero
NOT_READY = "the engine's process closed the connection before it was ready"
NOT_RUNNING = "the engine's process is not running: the engine model is not loaded (yet)"


class EngineProcessError(EngineFailure):
    """The engine's process failed to start, or ended."""


class _Admission:
    """A parent's `submit` waiting for the child's answer."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer: tuple = ()  # empty: the request ended (or the child did) before an answer


def runtime_dir() -> Path:
    """Where the children's sockets and lock files are: a folder of this user's that nobody else may enter (a
    connection may submit requests, pickled)."""
    folder = Path(tempfile.gettempdir()) / f"tritonllm-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise EngineProcessError(
            f"{folder} must be a folder of this user's that others cannot enter; remove it or set TMPDIR"
        )
    return folder


def socket_path(config: EngineConfig | SyntheticConfig, shared_as: str | None) -> Path:
    """The child's socket: one per `shared_as` and configuration; None gives a child of one's own."""
    scope = shared_as if shared_as is not None else secrets.token_hex(16)
    path = runtime_dir() / (hashlib.sha256(f"{scope}\n{config!r}".encode()).hexdigest()[:24] + ".sock")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise EngineProcessError(f"{path} is too long for a Unix socket's path: set TMPDIR to a shorter folder")
    return path


class EngineProcess(BlockingGenerate):
    """`PortableEngine`'s interface, served by a child process (the synthetic engine, for its configuration) that
    instances naming the same `shared_as` and configuration share (None: one of its own); with `start` False, only
    one already running (EngineProcessError when none is), as the engine model's other callers join it. `emit`
    callbacks run on this process's reader thread, in the order the child's engine made the emissions; the others
    there too: `on_stop` with the client request id of a `stop` request that any of the sharing instances received
    (`relay_stop`), `on_records` in the instance that reports the metrics with what another forwarded
    (`forward_records`)."""

    def __init__(
        self,
        config: EngineConfig | SyntheticConfig,
        shared_as: str | None = None,
        on_stop: Callable[[str], None] = lambda request_id: None,
        on_records: Callable[[list], None] = lambda records: None,
        start: bool = True,
    ) -> None:
        self._on_stop, self._on_records = on_stop, on_records
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._emits: dict[str, Callable[[Emission], None]] = {}
        self._ids = itertools.count()
        self._load = Load()  # the child's latest report
        self._ended: str | None = None  # why the child is gone, once it is
        self._admissions: dict[str, _Admission] = {}
        self._path = socket_path(config, shared_as)
        self._process: subprocess.Popen | None = None  # the child, when this instance started it
        with socket_lock(self._path):  # the child decides to exit holding it too
            conn = _connect(self._path)
            if conn is None and not start:
                raise EngineProcessError(NOT_RUNNING)
            if conn is None:
                self._process = _start(self._path)
                conn = _connect(self._path)
            answer = _handshake(conn, config)
            if answer[0] != READY:
                self._failed(conn, answer[1])
        self._conn: Connection = conn
        self.submit_rules: SubmitRules = answer[1]  # what the child's engine refuses, checked here: a 400 at once
        self._pid: int = answer[2]
        self._reports: bool = answer[3]  # whether this instance reports the engine's metrics
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    def _failed(self, conn: Connection | None, why: str) -> NoReturn:
        if conn is not None:
            conn.close()
        if self._process is not None:  # started here: reaped here
            code = _end_process(self._process, 30)
            if why == NOT_READY:
                why = f"it exited with code {code} before it was ready"
        lock_file(self._path).unlink(missing_ok=True)  # held here (socket_lock): a waiting instance takes a new one
        raise EngineProcessError(f"the engine's process failed to start: {why}")

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
        self._send((SUBMIT, request_id, request))
        if admission is not None:
            self._await_admission(request_id, request, admission)
        return request_id

    def _await_admission(self, request_id: str, request: GenerationRequest, admission: _Admission) -> None:
        """The child compiles the guide, or its end fails the request; InputError when it refuses the request, or
        has not answered within GUIDE_COMPILE_SECONDS (the child's engine has the same deadline, from when it got
        the request: this one is the caller's bound)."""
        seconds = GUIDE_COMPILE_SECONDS
        if not admission.done.wait(seconds):
            with self._lock:
                expired = self._admissions.pop(request_id, None) is not None
                if expired:
                    self._emits.pop(request_id, None)
            if expired:
                self._send((CANCEL, request_id))  # the child ends it if its engine takes it yet
                raise compile_too_slow(request.guide.type, seconds)
            admission.done.wait()  # answered meanwhile: it is being set
        if admission.answer[:1] == (REFUSED,):
            with self._lock:
                self._emits.pop(request_id, None)
            raise InputError(*admission.answer[1:])

    def cancel(self, request_id: str) -> None:
        with self._lock:
            live = request_id in self._emits
        if live:
            self._send((CANCEL, request_id))

    def relay_stop(self, request_id: str) -> bool:
        self._send((STOP, request_id))
        return True

    def reports_metrics(self) -> bool:
        return self._reports

    def forward_records(self, records: list) -> None:
        self._send((RECORDS, pickle.dumps(records)))

    def running(self) -> int:
        """Requests in the engine from every sharing instance: ours now, the others' at the child's latest report
        (at most LOAD_PERIOD old); none once the child is gone. Ours whose guide compiles are left out: the caller
        counts the requests `submit` has not returned (the engine model's admission does), as with an engine in the
        caller's process, which takes a request once its guide compiled."""
        load = self._load
        with self._lock:
            return 0 if self._ended else len(self._emits) - len(self._admissions) + max(0, load.everyone - load.ours)

    def in_batch(self) -> int:
        return self._load.in_batch

    def captured_graphs(self) -> int:
        return self._load.captured_graphs

    def steps(self) -> int | None:
        """The child's engine's, at its latest report (at most LOAD_PERIOD old): a stuck step stops the count, not
        the reports, which the child's other threads send."""
        return self._load.steps

    def alive(self) -> bool:
        """The child runs and, at its latest report, so does its engine's step loop (the health probe's first
        question: "the generation loop has stopped")."""
        return self._ended is None and self._load.alive

    def shutdown(self, timeout: float = 30.0) -> None:
        """This instance's requests fail, as the engines' own shutdown fails them, and its connection closes; the
        child's engine stops with its last connection, and the last instance waits for that (a child on its way out
        that has not exited by `timeout` is killed)."""
        self._end(SHUTDOWN_REASON)
        self._send((CLOSE,))  # the child cancels our requests and closes the connection
        self._reader.join(timeout)
        self._conn.close()
        if self._load.others == 0:  # none left but us, at the child's last word
            self._await_exit(timeout)
        elif self._process is not None:
            self._process.poll()  # it serves other instances on; reaped here if it is already gone

    def _await_exit(self, timeout: float) -> None:
        """The child, its last connection gone, removes its socket and stops its engine. One still listening serves
        an instance that connected meanwhile; one on its way out still there after `timeout` is killed."""
        deadline = time.monotonic() + timeout
        while not self._child_gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._child_gone() or self._path.exists():
            return
        if self._process is not None:
            _end_process(self._process, 0)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)

    def _child_gone(self) -> bool:
        if self._process is not None:
            return self._process.poll() is not None
        return not _is_engine_process(self._pid)

    # ------------------------------------------------------------------ the connection

    def _send(self, message: tuple) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # a child that is gone: the reader fails its requests
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                _, emissions, load, relayed = self._conn.recv()
                self._load = Load(*load)
            except (EOFError, OSError):
                break
            for request_id, fields in emissions:
                if isinstance(fields[0], str):
                    self._answered(request_id, fields)
                    continue
                emission = Emission(*fields)
                with self._lock:
                    emit = self._emits.pop(request_id, None) if emission.final else self._emits.get(request_id)
                    admission = self._admissions.pop(request_id, None) if emission.final else None
                if emit is not None:
                    emit(emission)
                if admission is not None:  # it failed in the child's submit: `emit` has its error
                    admission.done.set()
            for kind, payload in relayed:
                if kind == STOP:
                    self._on_stop(payload)
                elif kind == RECORDS:
                    self._on_records(pickle.loads(payload))
        # Not asked to close: the child is gone, and its code is known where it was started.
        died = self._ended is None
        code = self._process.wait() if died and self._process is not None else None
        reason = "the engine's process has stopped" if not code else f"the engine's process exited with code {code}"
        self._end(reason)
        if died:
            _remove_stale_socket(self._path)

    def _end(self, reason: str) -> None:
        """No more requests: those waiting for the child fail with `reason`."""
        with self._lock:
            self._ended = self._ended or reason
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
            emit(Emission([], FINISH_ERROR, f"{answer[1]}: {answer[2]}", error_kind=ErrorKind.INVALID_INPUT))


def _connect(path: Path) -> Connection | None:
    """A connection to the child listening at `path`; None when none does (a socket left by a killed child is
    removed: nothing listens on it, and a new child binds it under the lock the caller holds)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        path.unlink(missing_ok=True)
        return None
    return Connection(sock.detach())


def _handshake(conn: Connection | None, config: EngineConfig | SyntheticConfig) -> tuple:
    """The child's answer to the configuration: (READY, rules, pid, reports metrics) or (FAILED, why)."""
    try:
        if conn is None:  # the child just started is gone
            raise EOFError
        conn.send((CONFIG, config))
        return conn.recv()
    except (EOFError, OSError):
        return (FAILED, NOT_READY)


def _remove_stale_socket(path: Path) -> None:
    """A dead child's socket and lock file, unless another instance has started a child there since (under the lock,
    as they do): connecting tells, and removes a socket nothing listens on."""
    with socket_lock(path):
        conn = _connect(path)
        if conn is not None:
            conn.close()  # a live child's: it drops a connection that sends no configuration
        else:
            remove_socket(path)


def _is_engine_process(pid: int) -> bool:
    """Whether `pid` is still an engine's process (not exited, not a zombie, not a reused pid)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return state != "Z" and b"tritonllm.engine.process_child" in command


def _end_process(process: subprocess.Popen, timeout: float) -> int:
    """`process`'s exit code, killed if it has not exited in `timeout` seconds."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _start(path: Path) -> subprocess.Popen:
    """The child, listening at `path`: bound here, so that connecting succeeds as soon as this returns."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    try:
        # In a stub, sys.executable is the server environment's python, whose packages the stub imports.
        return subprocess.Popen(
            [sys.executable, "-m", "tritonllm.engine.process_child", str(listener.fileno()), str(path)],
            pass_fds=[listener.fileno()],
        )
    finally:
        listener.close()
