"""The engine in a child process (tritonllm/engine/process.py, process_child.py): the same answers as in-process,
cancellation, one child shared by several instances, and what its callers see when the child dies or fails to
start."""

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from tests.polling import eventually
from tritonllm.engine import process, process_child
from tritonllm.engine.api import (
    Emission,
    EngineConfig,
    GenerationRequest,
    Guide,
    SamplingParams,
    SubmitRules,
    TokenLogProbs,
)
from tritonllm.engine.portable import PortableEngine
from tritonllm.engine.process import (
    EngineProcess,
    EngineProcessError,
    _connect,
    _handshake,
    _is_engine_process,
    socket_path,
)
from tritonllm.engine.process_child import (
    ADMITTED,
    CANCEL,
    CLOSE,
    CONFIG,
    LOAD_PERIOD,
    READY,
    SUBMIT,
    emission_fields,
    lock_file,
    serve,
    socket_lock,
)
from tritonllm.engine.synthetic import SyntheticConfig
from tritonllm.errors import ErrorKind, InputError
from tritonllm.protocol import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, MAX_WORD_SEQUENCES


def small(manifest) -> EngineConfig:
    return EngineConfig(manifest["model_dir"], dtype=manifest["dtype"], max_batch_size=4, max_seq_len=512)


@pytest.fixture(scope="module")
def child(manifest):
    engine = EngineProcess(small(manifest))
    yield engine
    engine.shutdown()


def test_answers_equal_the_engine_in_process(child, manifest, tokenizer):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    banned = (tuple(tokenizer.encode(" Paris", add_special_tokens=False)),)
    requests = [
        GenerationRequest(ids, 12, end_id=tokenizer.eos_token_id),
        GenerationRequest(ids, 12, bad_words=banned),
        GenerationRequest(ids, 12, sampling=SamplingParams(True, 0.8, 0, 0.9, 5)),
        GenerationRequest(ids, 12, stop_words=((13,),)),
    ]
    here = PortableEngine(small(manifest))
    try:
        expected = [here.generate(r, timeout=120) for r in requests]
    finally:
        here.shutdown()
    # All at once, so they share the child's batch.
    results: list = [None] * len(requests)
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, child.generate(requests[i], timeout=120)))
        for i in range(len(requests))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected


@pytest.mark.parametrize(
    "emission",
    [
        Emission([7]),
        Emission([], FINISH_ERROR, "the engine failed"),
        Emission([], FINISH_ERROR, "min_tokens: is 6", error_kind=ErrorKind.INVALID_INPUT),  # a 400 in the parent
        Emission(
            [7, 8], FINISH_LENGTH, None, [TokenLogProbs(-0.5, ((7, -0.5),)), TokenLogProbs(-1.0)], 0.1, 0.02, 0.01, 3
        ),
    ],
)
def test_an_emission_crosses_as_its_fields(emission):
    """Emissions travel as plain tuples (pickling the dataclass cost the sender several times more); every field
    comes back, and the first item is never a name, which is how the parent tells them from answers."""
    fields = pickle.loads(pickle.dumps(emission_fields(emission)))
    assert Emission(*fields) == emission and not isinstance(fields[0], str)


def test_a_stream_arrives_token_by_token_in_order(child):
    emissions: list[Emission] = []
    child.submit(GenerationRequest([1, 2, 3, 4], 6, streaming=True), emissions.append)
    assert eventually(lambda: emissions and emissions[-1].final, 30)
    assert [e.final for e in emissions] == [False] * (len(emissions) - 1) + [True]
    assert sum(len(e.token_ids) for e in emissions) == 6
    assert emissions[-1].finish_reason == FINISH_LENGTH and emissions[-1].time_to_first_token > 0
    assert child.running() == 0


def test_the_childs_step_count_reaches_the_parent(child):
    """What the health probe reads to tell a stuck step in the child (tritonllm/engine/health.py)."""
    assert eventually(lambda: child.steps() is not None, 10 * LOAD_PERIOD)
    before = child.steps()
    child.generate(GenerationRequest([1, 2, 3], 4), timeout=60)
    assert eventually(lambda: child.steps() >= before + 4, 10 * LOAD_PERIOD)


def test_cancel_frees_the_request(child):
    emissions: list[Emission] = []
    request_id = child.submit(GenerationRequest([1, 2, 3], 400, streaming=True), emissions.append)
    assert eventually(lambda: emissions, 30)  # generating
    assert child.running() == 1
    assert eventually(lambda: child.in_batch() == 1, 30)  # the child's load report
    child.cancel(request_id)
    assert eventually(lambda: emissions[-1].final, 30)
    assert emissions[-1].finish_reason == FINISH_CANCELLED
    assert child.running() == 0
    assert eventually(lambda: child.in_batch() == 0, 30)


def test_refuses_what_the_engine_refuses_before_sending(child):
    with pytest.raises(InputError, match="bad_words: 65 sequences"):
        child.submit(GenerationRequest([1], 2, bad_words=((5,),) * (MAX_WORD_SEQUENCES + 1)), lambda e: None)
    assert child.running() == 0


def test_a_dead_child_fails_its_requests_and_every_later_one(manifest):
    engine = EngineProcess(small(manifest))
    emissions: list[Emission] = []
    engine.submit(GenerationRequest([1, 2, 3], 400), emissions.append)
    assert eventually(lambda: engine.in_batch() == 1, 30)
    os.kill(engine._process.pid, signal.SIGKILL)
    assert eventually(lambda: emissions, 30)
    (failed,) = emissions
    assert failed.finish_reason == FINISH_ERROR and "exited with code -9" in failed.error
    assert not engine.alive() and engine.running() == 0
    later: list[Emission] = []
    engine.submit(GenerationRequest([1], 2), later.append)
    assert later[0].finish_reason == FINISH_ERROR
    engine.shutdown()


def test_the_child_exits_when_its_parent_dies(manifest):
    """A killed engine model's process closes the socket, and the child exits: no orphan holds a GPU's memory."""
    parent = (
        "import os, signal, sys\n"
        "from tritonllm.engine.api import EngineConfig\n"
        "from tritonllm.engine.process import EngineProcess\n"
        "engine = EngineProcess(EngineConfig(sys.argv[1], max_batch_size=2, max_seq_len=256))\n"
        "print(engine._process.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    run = subprocess.run([sys.executable, "-c", parent, manifest["model_dir"]], capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    stat = Path(f"/proc/{int(run.stdout.split()[0])}/stat")
    # Gone, or a zombie that nobody reaped (a container's first process may not).
    assert eventually(lambda: not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", 30)


def test_a_failed_start_says_why(tmp_path):
    with pytest.raises(EngineProcessError, match=r"process failed to start: OSError: .*missing"):
        EngineProcess(EngineConfig(str(tmp_path / "missing")))


class CompilingEngine:
    """A stand-in engine whose `submit` of a guided request blocks until the test says, as a new grammar's compile
    does; a plain request ends inside its `submit`, before its id is returned."""

    submit_rules = SubmitRules(vocab_size=100)

    def __init__(self) -> None:
        self.compiled = threading.Event()
        self.cancels: list[str] = []
        self.guided = 0  # guided submits it was given

    def submit(self, request, emit) -> str:
        if request.guide is None:
            emit(Emission([5], FINISH_LENGTH))
            return "plain"
        self.guided += 1
        assert self.compiled.wait(30)
        return "guided"

    def cancel(self, engine_id: str) -> None:
        self.cancels.append(engine_id)

    def in_batch(self) -> int:
        return 0

    def captured_graphs(self) -> int:
        return 0

    def steps(self) -> int:
        return 0

    def alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def serve_compiling(path: Path) -> tuple[CompilingEngine, threading.Thread]:
    """A CompilingEngine served at `path` by this process's threads, as the engine's process serves its own."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    engine = CompilingEngine()
    served = threading.Thread(target=serve, args=(listener, path, lambda _: engine), daemon=True)
    served.start()
    return engine, served


def test_a_compiling_guide_holds_up_neither_emissions_nor_other_requests(tmp_path):
    path = tmp_path / "engine.sock"
    engine, served = serve_compiling(path)
    parent = Client(str(path), family="AF_UNIX")
    parent.send((CONFIG, None))
    assert parent.poll(10)
    ready = parent.recv()  # with what the parent checks, and that the first connection reports the metrics
    assert ready == (READY, CompilingEngine.submit_rules, os.getpid(), True)
    guided = GenerationRequest([1, 2], max_new_tokens=1, guide=Guide("regex", "[0-9]+"))
    parent.send((SUBMIT, "p0", guided))
    parent.send((SUBMIT, "p1", GenerationRequest([1, 2], max_new_tokens=1)))
    got = []
    deadline = time.monotonic() + 10
    while not any(request_id == "p1" for request_id, _ in got):
        assert parent.poll(max(0.0, deadline - time.monotonic())), "the plain request waited on the compile"
        got += parent.recv()[1]
    parent.send((CANCEL, "p0"))  # while its guide compiles: the engine cancels it once it has it
    time.sleep(0.2)
    engine.compiled.set()
    while ("p0", (ADMITTED,)) not in got:
        assert parent.poll(10)
        got += parent.recv()[1]
    assert eventually(lambda: engine.cancels == ["guided"], 10)
    parent.send((CLOSE,))  # the stand-in never ends it: the connection's end cancels it again
    served.join(10)
    assert engine.cancels == ["guided", "guided"] and not served.is_alive() and not path.exists()


def test_guided_submits_wait_for_a_submitter_and_one_cancelled_meanwhile_ends_at_once(tmp_path, monkeypatch):
    """Guided submits took a thread each: a few guides that compile for long held as many threads, without bound."""
    monkeypatch.setattr(process_child, "GUIDED_SUBMITS", 1)
    path = tmp_path / "engine.sock"
    engine, served = serve_compiling(path)
    parent = Client(str(path), family="AF_UNIX")
    parent.send((CONFIG, None))
    assert parent.poll(10) and parent.recv()[0] == READY
    guided = GenerationRequest([1, 2], max_new_tokens=1, guide=Guide("regex", "[0-9]+"))
    parent.send((SUBMIT, "p0", guided))
    parent.send((SUBMIT, "p1", guided))  # waits for the only submitter
    parent.send((CANCEL, "p1"))
    assert eventually(lambda: engine.guided == 1, 10)
    time.sleep(0.2)
    engine.compiled.set()
    got: list = []
    while ("p0", (ADMITTED,)) not in got or not any(request_id == "p1" for request_id, _ in got):
        assert parent.poll(10)
        got += parent.recv()[1]
    (ended,) = [Emission(*fields) for request_id, fields in got if request_id == "p1"]
    assert ended.finish_reason == FINISH_CANCELLED and engine.guided == 1  # never given to the engine
    parent.send((CLOSE,))
    served.join(10)
    assert not served.is_alive()


SCOPE = f"tests-{os.getpid()}"  # the children these tests share live in the user's folder: one run's own
SYNTHETIC = SyntheticConfig(tuple(range(100, 140)), max_batch_size=4, step_ms=1, engine_process=True)


def test_a_guide_not_compiled_in_time_fails_its_submit_counted_once_and_the_child_drops_it(monkeypatch):
    """The parent waited for the child's answer without end; and it counted a request whose guide compiles in
    `running()`, as its caller's admission does too."""
    monkeypatch.setattr(process, "GUIDE_COMPILE_SECONDS", 0.5)
    engine, served = serve_compiling(socket_path(SYNTHETIC, f"{SCOPE}:compiling"))
    instance = EngineProcess(SYNTHETIC, f"{SCOPE}:compiling")
    failure: list[Exception] = []

    def submit() -> None:
        try:
            instance.submit(GenerationRequest([1, 2], 1, guide=Guide("regex", "[0-9]+")), lambda e: None)
        except Exception as exc:
            failure.append(exc)

    submitting = threading.Thread(target=submit)
    try:
        submitting.start()
        assert eventually(lambda: engine.guided == 1, 10)
        time.sleep(2 * LOAD_PERIOD)  # the child's load report counts it too
        assert instance.running() == 0
        submitting.join(5)
        assert not submitting.is_alive(), "the submit waits for the compile"
        (refused,) = failure
        assert isinstance(refused, InputError) and refused.field == "guided_decoding_guide"
        assert str(refused).endswith("the regex guide did not compile within the limit of 0.5 s")
        engine.compiled.set()
        assert eventually(lambda: engine.cancels == ["guided"], 10)  # the child's engine took it late: cancelled
        assert instance.running() == 0
    finally:
        engine.compiled.set()
        submitting.join(10)
        instance.shutdown()
        served.join(10)
    assert not served.is_alive()


def tokens(engine: EngineProcess, request: GenerationRequest) -> list[int]:
    emissions: list[Emission] = []
    engine.submit(request, emissions.append)
    assert eventually(lambda: emissions and emissions[-1].final, 10)
    return [t for e in emissions for t in e.token_ids]


def test_instances_sharing_one_engine():
    """Instances of the engine model on one server share the engine's process: each gets its own requests'
    emissions, admission counts everyone's, a stop request reaches every instance, one reports the metrics with the
    others' records, and the child ends with the last of them."""
    stops: list[tuple[str, str]] = []
    records: list[tuple[str, list]] = []
    first, second = (
        EngineProcess(
            SYNTHETIC,
            f"{SCOPE}:model",
            lambda rid, name=name: stops.append((name, rid)),
            lambda got, name=name: records.append((name, got)),
        )
        for name in ("first", "second")
    )
    other = EngineProcess(SyntheticConfig(SYNTHETIC.text_ids, max_batch_size=2, step_ms=1), f"{SCOPE}:model")
    path = socket_path(SYNTHETIC, f"{SCOPE}:model")
    try:
        assert first._process is not None and second._process is None  # started once
        assert other._process is not None  # another configuration: another engine
        long = GenerationRequest([1, 2], 100_000, streaming=True)
        mine: list[Emission] = []
        request_id = first.submit(long, mine.append)
        assert eventually(lambda: second.running() == 1, 10)  # the first's request, from the child's report
        assert first.running() == 1 and other.running() == 0
        assert len(tokens(second, GenerationRequest([1], 6, streaming=True))) == 6
        second.relay_stop("client-7")
        assert eventually(lambda: sorted(stops) == [("first", "client-7"), ("second", "client-7")], 10)
        # One reports the metrics, the oldest connection; the other's records go to it.
        assert eventually(lambda: first.reports_metrics() and not second.reports_metrics(), 10)
        second.forward_records(["busy", "busy"])
        assert eventually(lambda: records == [("first", ["busy", "busy"])], 10)
        # The instance that started it leaves first: at once, its requests failed, the other served on.
        started = time.monotonic()
        first.shutdown()
        assert time.monotonic() - started < 5 and first._process.poll() is None
        assert mine[-1].final and mine[-1].finish_reason == FINISH_ERROR and request_id
        assert len(tokens(second, GenerationRequest([1], 4))) == 4
        assert not second.reports_metrics()  # the metrics never move to another instance
        pid = second._pid
        second.shutdown()  # the last: it waits for the child to exit
        assert not _is_engine_process(pid) and not path.exists() and not lock_file(path).exists()
        assert eventually(lambda: first._process.poll() == 0, 10)
    finally:
        first.shutdown()
        other.shutdown()
        second.shutdown()


def test_a_killed_shared_engine_is_started_again_by_the_next_instance():
    path = socket_path(SYNTHETIC, f"{SCOPE}:killed")
    first = EngineProcess(SYNTHETIC, f"{SCOPE}:killed")
    os.kill(first._process.pid, signal.SIGKILL)
    assert eventually(lambda: not first.alive(), 10)
    # Its socket and lock file, removed by the instance that started it.
    assert eventually(lambda: not path.exists() and not lock_file(path).exists(), 10)
    # A socket left with nobody to remove it (the instances killed too): the next instance replaces it.
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(path))
    left.close()
    again = EngineProcess(SYNTHETIC, f"{SCOPE}:killed")
    try:
        assert again._process is not None and len(tokens(again, GenerationRequest([1], 3))) == 3
    finally:
        again.shutdown()
        first.shutdown()
    assert not path.exists()


def test_the_engine_stays_while_an_instance_is_connecting():
    """An instance holds the lock from connecting until the child answered it: the child, its last connection
    gone, does not leave meanwhile (the instance would connect to an engine on its way out)."""
    only = EngineProcess(SYNTHETIC, f"{SCOPE}:connecting")
    path = socket_path(SYNTHETIC, f"{SCOPE}:connecting")
    with socket_lock(path):  # as an instance about to connect
        only.shutdown(timeout=0.5)  # the last connection: the child would leave now
        time.sleep(3 * LOAD_PERIOD)
        assert only._process.poll() is None and path.exists()
        late = _connect(path)
        assert late is not None and _handshake(late, SYNTHETIC)[0] == READY
    late.close()  # now the last connection ends with nobody connecting: the child leaves
    assert only._process.wait(10) == 0 and not path.exists() and not lock_file(path).exists()


def blocked_on(inode: int) -> bool:
    """Whether a flock on the file of `inode` is waited for (Linux's /proc/locks: "-> FLOCK ... MAJ:MIN:INODE")."""
    return any("->" in line and line.split()[-3].endswith(f":{inode}") for line in open("/proc/locks"))


def test_a_lock_removed_while_waited_for_is_taken_anew(tmp_path):
    """The child removes the lock's file holding it; an instance that was waiting on that file must then lock the
    path's new file, or a third could lock that one too and both start a child."""
    path = tmp_path / "engine.sock"
    holding, release = threading.Event(), threading.Event()

    def waiter() -> None:
        with socket_lock(path):
            holding.set()
            release.wait(10)

    with socket_lock(path):
        waiting = threading.Thread(target=waiter)
        waiting.start()
        inode = os.stat(lock_file(path)).st_ino
        assert eventually(lambda: blocked_on(inode), 10)  # the waiter has opened the file and waits for its lock
        lock_file(path).unlink()
    assert holding.wait(10)
    with socket_lock(path, wait=False) as third:
        assert not third  # the waiter holds the lock of the file now at the path
    release.set()
    waiting.join(10)
