"""Integration: faults. A killed engine, a step that raises, SIGTERM, client timeouts — bounded, loopback only."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client import GenerationError, generate, infer_inputs, request_tensors, stream
from tests.conftest import BUILD, ROOT
from tests.integration.test_streaming import wait_for_in_flight
from tests.polling import eventually
from tritonllm.engine.synthetic import SYNTHETIC_CONFIG_FILE
from tritonllm.launch.tritonserver import TritonServer, free_port, http_ready, metric_samples, metric_value
from tritonllm.protocol import DECOUPLED_ENGINE_MODEL, stop_request_tensors
from tritonllm.repository.builder import main as build_main

pytestmark = pytest.mark.integration


class Serve:
    """`python -m tritonllm.launch.serve` (what `make serve` runs) as a subprocess on free ports."""

    def __init__(self, tmp_path, *extra: str, repository=BUILD / "model_repository") -> None:
        self.http, self.grpc, self.metrics = free_port(), free_port(), free_port()
        self.log = tmp_path / "serve.log"
        command = [
            sys.executable,
            "-m",
            "tritonllm.launch.serve",
            "--repository",
            str(repository),
            "--http-port",
            str(self.http),
            "--grpc-port",
            str(self.grpc),
            "--metrics-port",
            str(self.metrics),
            "--openai-port",
            "0",
            *extra,
        ]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        assert self.wait_ready(600), self.tail()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http}"

    def ready(self) -> bool:
        return http_ready(self.url)

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            if self.ready():
                return True
            time.sleep(0.5)
        return False

    def tritonserver_pid(self) -> int:
        out = subprocess.run(
            ["pgrep", "-P", str(self.process.pid), "-f", "tritonserver"], capture_output=True, text=True
        )
        return int(out.stdout.split()[0])

    def engine_stub_pids(self) -> list[int]:
        """The engine model's instances' stubs."""
        server = str(self.tritonserver_pid())
        out = subprocess.run(
            ["pgrep", "-a", "-f", f"{DECOUPLED_ENGINE_MODEL}/1/model.py"], capture_output=True, text=True
        ).stdout
        stubs = [int(line.split()[0]) for line in out.splitlines() if server in line.split()]
        assert stubs, f"no engine stub of tritonserver {server}: {out}"
        return stubs

    def engine_stub_pid(self) -> int:
        return self.engine_stub_pids()[0]

    def engine_child_pid(self) -> int:
        """The process of an engine built with --engine-process (tritonllm/engine/process_child.py), which one of
        the instances started and all of them share."""
        children = [
            int(pid)
            for stub in self.engine_stub_pids()
            for pid in subprocess.run(["pgrep", "-P", str(stub)], capture_output=True, text=True).stdout.split()
        ]
        (pid,) = children
        return pid

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10) as response:
            return metric_value(metric_samples(response.read().decode()), name)

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def in_background(function, *args, **kwargs) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        started = time.monotonic()
        try:
            result["value"] = function(*args, **kwargs)
        except Exception as exc:
            result["error"] = exc
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.fixture(scope="module")
def engine_process_build(tmp_path_factory, manifest):
    """The default build with the engine in a process of its own (the default on CUDA), shared by two instances
    of the engine model."""
    from tritonllm.repository.builder import main as build_main

    build = tmp_path_factory.mktemp("engine-process")
    argv = ["--model", manifest["model_dir"], "--build-dir", str(build), "--engine-process", "--engine-instances", "2"]
    assert build_main(argv) == 0
    return build


@pytest.fixture(scope="module")
def engine_process_serve(tmp_path_factory, engine_process_build):
    """`make serve` on that build, started once (a start loads torch and the model): the test that kills its engine
    runs last."""
    serve = Serve(
        tmp_path_factory.mktemp("engine-process-serve"),
        "--watchdog-seconds",
        "1",
        repository=engine_process_build / "model_repository",
    )
    yield serve
    serve.stop()


def test_the_engine_in_its_own_process_answers_as_in_the_model_process(engine_process_serve, server):
    serve = engine_process_serve
    prompt = "What is the capital of France?"
    assert len(serve.engine_stub_pids()) == 2 and serve.engine_child_pid()  # one engine for both instances
    # Only the engine's process loads torch; the stub parses requests and sends responses.
    assert "libtorch" not in Path(f"/proc/{serve.engine_stub_pid()}/maps").read_text()
    assert "libtorch" in Path(f"/proc/{serve.engine_child_pid()}/maps").read_text()
    assert generate(prompt, 16, url=serve.url) == generate(prompt, 16, url=server.http_url)
    streamed = "".join(c.text for c in stream(prompt, 16, url=f"127.0.0.1:{serve.grpc}"))
    assert streamed == generate(prompt, 16, url=server.http_url)

    # Both requests counted once, whichever instance served them: one instance reports the engine's metrics.
    finished = "tritonllm_requests_finished_total"
    assert eventually(lambda: serve.metric(finished) == 2, 10), serve.metric(finished)


def test_a_stop_request_ends_a_stream_whichever_instance_it_reaches(engine_process_serve):
    """TensorRT-LLM's `stop` request reaches one instance of the engine model, and Triton picks which: the engine's
    process relays it to every instance (tritonllm/engine/process_child.py). Which instance gets the stream and
    which the stop is Triton's choice, not checked here; tests/unit/engine/test_process.py checks the relay."""
    grpc_url = f"127.0.0.1:{engine_process_serve.grpc}"
    prompt = [
        ("input_ids", np.array([[1, 2, 3, 4]], np.int32), "INT32"),
        ("input_lengths", np.array([[4]], np.int32), "INT32"),
    ]
    long = [
        *prompt,
        ("request_output_len", np.array([[400]], np.int32), "INT32"),
        ("streaming", np.array([[True]]), "BOOL"),
    ]
    for attempt in range(4):  # one stream and one stop at a time, each placed by Triton
        responses: queue.Queue = queue.Queue()
        with (
            grpcclient.InferenceServerClient(grpc_url) as triton,
            grpcclient.InferenceServerClient(grpc_url) as stopper,
        ):
            triton.start_stream(callback=lambda result, error, answers=responses: answers.put((result, error)))
            triton.async_stream_infer(
                DECOUPLED_ENGINE_MODEL,
                infer_inputs(grpcclient, long),
                request_id=f"long-{attempt}",
                enable_empty_final_response=True,
            )
            got = [responses.get(timeout=60)]  # generating
            stopper.start_stream(callback=lambda result, error: None)
            stopper.async_stream_infer(
                DECOUPLED_ENGINE_MODEL, infer_inputs(grpcclient, stop_request_tensors()), request_id=f"long-{attempt}"
            )
            while not got[-1][0].get_response().parameters["triton_final_response"].bool_param:
                got.append(responses.get(timeout=60))
            stopper.stop_stream()
            triton.stop_stream()
        assert all(error is None for _, error in got)
        generated = sum(
            len(result.as_numpy("output_ids").reshape(-1))
            for result, _ in got
            if result.as_numpy("output_ids") is not None
        )
        assert 0 < generated < 400, f"attempt {attempt}: the stop did not end the stream"


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-in-the-stub", "engine-process"])
def test_killed_engine_fails_in_flight_requests_and_serving_comes_back(tmp_path, engine_process, request):
    """Killing the engine model's process, or with --engine-process the engine's own (the stub then lives on and
    the health probe finds its generation loop stopped)."""
    if engine_process:
        serve = request.getfixturevalue("engine_process_serve")
    else:
        serve = Serve(tmp_path, "--watchdog-seconds", "1", repository=BUILD / "model_repository")
    try:
        answer = generate("What is the capital of France?", 12, url=serve.url)
        thread, result = in_background(generate, "Tell me a very long story.", 400, url=serve.url, timeout=300)
        time.sleep(2)
        os.kill(serve.engine_child_pid() if engine_process else serve.engine_stub_pid(), signal.SIGKILL)
        killed = time.monotonic()
        thread.join(120)
        assert "error" in result, f"the in-flight request did not fail: {result}"
        assert time.monotonic() - killed < 60, "the in-flight request hung instead of failing"
        # The server is restarted: not ready for a while, then ready, then answering as before.
        deadline, seen_not_ready = time.monotonic() + 60, False
        while time.monotonic() < deadline and not seen_not_ready:
            seen_not_ready = not serve.ready()
            time.sleep(0.2)
        assert seen_not_ready, "health still said ready with a dead engine"
        assert serve.wait_ready(600), serve.tail()
        assert generate("What is the capital of France?", 12, url=serve.url) == answer
        assert "restarting tritonserver" in serve.log.read_text()
    finally:
        serve.stop()


FAULT_SECONDS = 30  # from the injected fault to the last in-flight request's error
RECOVERY_SECONDS = 120  # from the fault to serving again: two failed probes, a kill and tritonserver's start
LONG = 1500  # tokens: 15 s of 10 ms steps, far more than the test waits before the fault


def engine_stream(grpc_url: str, first_id: int, tokens: list) -> None:
    """A stream from the engine model itself (TensorRT-LLM's streaming interface, and the OpenAI layer's path): its
    tokens into `tokens` as they come; raises GenerationError with the error that ends it."""
    tensors = [
        ("input_ids", np.array([[first_id, 2, 3, 4]], np.int32), "INT32"),
        ("input_lengths", np.array([[4]], np.int32), "INT32"),
        ("request_output_len", np.array([[LONG]], np.int32), "INT32"),
        ("streaming", np.array([[True]]), "BOOL"),
    ]
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(grpc_url) as triton:
        triton.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            triton.async_stream_infer(
                DECOUPLED_ENGINE_MODEL,
                infer_inputs(grpcclient, tensors),
                request_id=f"stream-{first_id}",
                enable_empty_final_response=True,
            )
            while True:
                result, error = answers.get(timeout=FAULT_SECONDS * 2)
                if error is not None:
                    raise GenerationError(error.message())
                if result.as_numpy("output_ids") is not None:
                    tokens.extend(result.as_numpy("output_ids").reshape(-1).tolist())
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return
        finally:
            triton.stop_stream()


def streamed(prompt: str, url: str, chunks: list, timeout: float) -> None:
    """The client's stream (through tensorrt_llm_bls): its chunks into `chunks` as they come; raises as it does."""
    for chunk in stream(prompt, LONG, url=url, timeout=timeout):
        chunks.append(chunk)


@pytest.fixture(scope="module")
def faulting_build(tmp_path_factory, manifest) -> tuple[Path, Path]:
    """The synthetic engine (10 ms a step) in the engine model's process, with its fault injection armed by a file
    (tritonllm/engine/synthetic.py): no step raises until a test creates the file, and the step that raises removes
    it. (A killed engine process is test_killed_engine_fails_in_flight_requests_and_serving_comes_back's.)"""
    folder = tmp_path_factory.mktemp("faulting")
    build, armed = folder / "build", folder / "fault-armed"
    argv = ["--engine", "synthetic", "--model", manifest["model_dir"], "--build-dir", str(build)]
    assert build_main([*argv, "--no-engine-process", "--step-ms", "10", "--max-seq-len", "2048"]) == 0
    path = build / "model_repository" / DECOUPLED_ENGINE_MODEL / "1" / SYNTHETIC_CONFIG_FILE
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "fault_at_step": 1, "fault_file": str(armed)}))
    return build, armed


def test_a_step_fault_fails_every_request_in_flight_and_the_watchdog_brings_serving_back(tmp_path, faulting_build):
    """An exception in the engine's step, not a kill: the stub lives on, the step loop's guard fails what it holds,
    and only the watchdog's probe (the loop has stopped) tells that the engine is gone: it restarts tritonserver."""
    build, armed = faulting_build
    serve = Serve(tmp_path, "--watchdog-seconds", "1", repository=build / "model_repository")
    try:
        prompt = "Tell me about the river."
        answer = generate(prompt, 12, url=serve.url)
        streams: list[list] = [[], [], []]
        running = [in_background(engine_stream, f"127.0.0.1:{serve.grpc}", i + 1, streams[i]) for i in range(3)]
        running += [in_background(generate, f"Answer {i}.", LONG, url=serve.url, timeout=120) for i in range(3)]
        in_flight = "tritonllm_engine_requests_in_flight"  # all six in the engine, and every stream under way
        assert eventually(lambda: all(streams) and serve.metric(in_flight) == 6, 30), serve.metric(in_flight)
        armed.touch()
        faulted = time.monotonic()
        for thread, _ in running:
            thread.join(FAULT_SECONDS)
        assert time.monotonic() - faulted < FAULT_SECONDS, "a request in flight hung after the engine's step failed"
        for _, result in running:  # never an empty success: each names the fault
            assert "injected fault at step" in str(result.get("error")), result
        assert not armed.exists(), "the fault did not fire"
        # The probe finds the loop stopped; the server is killed (not ready), started again, and answers as before.
        deadline, seen_not_ready = faulted + RECOVERY_SECONDS, False
        while time.monotonic() < deadline and not seen_not_ready:
            seen_not_ready = not serve.ready()
            time.sleep(0.1)
        assert seen_not_ready, "health still said ready with the engine's step loop stopped"
        assert serve.wait_ready(deadline - time.monotonic()), serve.tail()
        assert generate(prompt, 12, url=serve.url) == answer
        log = serve.log.read_text()
        assert "RuntimeError: injected fault at step" in log  # the step loop's guard logged the exception
        assert "the engine's generation loop has stopped); restarting tritonserver" in log
    finally:
        serve.stop()


def test_a_step_fault_reaches_a_stream_through_tensorrt_llm_bls(faulting_build):
    """tritonserver 2.51's Python backend never hands the BLS iterator an error response that follows another, so
    the stream used to wait until its deadline; tensorrt_llm_bls now asks for it in band (protocol.ERRORS_IN_BAND)."""
    build, armed = faulting_build
    armed.unlink(missing_ok=True)
    server = TritonServer.on_free_ports(build, log_file=build / "bls-server.log")
    server.start(timeout=300)
    try:
        chunks: list = []
        thread, result = in_background(streamed, "Tell me.", f"127.0.0.1:{server.grpc_port}", chunks, 10)
        assert eventually(lambda: chunks, 30), "the stream did not start"
        armed.touch()
        thread.join(30)
        assert not armed.exists(), "the fault did not fire"
        assert not thread.is_alive(), "the stream hung after the engine's error"
        assert "injected fault at step" in str(result.get("error")), result
    finally:
        server.kill()  # not stop(): a hung request would hold up tritonserver's exit


def check_restricted_apis(serve: Serve) -> None:
    """With an admin key, the model-repository and logging APIs need it; inference and health do not."""
    for path, method in (("/v2/repository/index", "POST"), ("/v2/logging", "GET")):
        for headers, expected in (
            ({}, 403),
            ({"tritonllm-admin-key": "wrong"}, 403),
            ({"tritonllm-admin-key": "let-me-in"}, 200),
        ):
            request = urllib.request.Request(
                f"http://{serve.url}{path}", method=method, headers=headers, data=b"{}" if method == "POST" else None
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    status = response.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            assert status == expected, (path, headers, status)
    assert serve.ready()


def test_sigterm_finishes_in_flight_requests_refuses_new_ones_and_exits_0(tmp_path):
    serve = Serve(tmp_path, "--watchdog-seconds", "0", "--admin-key", "let-me-in")
    try:
        check_restricted_apis(serve)
        running = [in_background(generate, f"Count slowly from one to {n}0.", 24, url=serve.url) for n in (5, 6, 7)]
        time.sleep(1.5)
        serve.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises((GenerationError, OSError)):
            generate("Too late?", 4, url=serve.url, timeout=30)
        for thread, result in running:
            thread.join(120)
            assert "value" in result, f"an in-flight request failed on SIGTERM: {result}"
        assert serve.process.wait(90) == 0, serve.tail()
    finally:
        serve.stop()


def test_client_timeout_ends_the_request_and_frees_its_slot(server):
    assert wait_for_in_flight(server, 0) == 0
    errors = []
    triton = grpcclient.InferenceServerClient(f"{server.host}:{server.grpc_port}")
    triton.start_stream(callback=lambda result, error: error and errors.append(error), stream_timeout=2)
    tensors = [
        *request_tensors("Tell me a very long story.", 3000),
        ("stream", np.array([[True]]), "BOOL"),
        ("end_id", np.array([[-1]], np.int32), "INT32"),
    ]
    triton.async_stream_infer("tensorrt_llm_bls", infer_inputs(grpcclient, tensors))
    time.sleep(4)
    triton.stop_stream()
    triton.close()
    assert errors and "Deadline" in errors[0].message()
    assert wait_for_in_flight(server, 0) == 0, "the engine kept generating for a client that timed out"
