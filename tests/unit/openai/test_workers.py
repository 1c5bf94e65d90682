"""Unit: the OpenAI layer's workers each listen on a socket of their own (tritonllm/openai/workers.py)."""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys

import pytest
from uvicorn.config import STARTUP_FAILURE

from tritonllm.launch.tritonserver import free_port
from tritonllm.openai.workers import WorkerSockets, bind_worker_sockets, reserve_port
from tritonllm.options import carrier_count

HOST = "127.0.0.1"


def accepted(listener: socket.socket) -> int:
    listener.setblocking(False)
    count = 0
    while True:
        try:
            listener.accept()[0].close()
        except BlockingIOError:
            return count
        count += 1


def test_each_worker_listens_on_its_own_socket_and_the_kernel_spreads_connections():
    """What uvicorn hands two workers, unpickled as each worker does: two sockets on the supervisor's port, beside
    the socket that reserves it; 64 connections go to both."""
    port = free_port()
    with reserve_port(HOST, port):
        handed = WorkerSockets(HOST, port)
        assert list(handed) == []  # the supervisor holds no listening socket
        listeners = [pickle.loads(pickle.dumps(handed)) for _ in range(2)]
        assert all(len(own) == 1 for own in listeners)
        listeners = [own[0] for own in listeners]
        for listener in listeners:
            listener.listen(64)
        clients = [socket.create_connection((HOST, port)) for _ in range(64)]
        counts = [accepted(listener) for listener in listeners]
        for sock in [*clients, *listeners]:
            sock.close()
    assert sum(counts) == 64
    assert min(counts) >= 8, counts  # binomial(64, 1/2): fewer than 8 has odds under 1e-9


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_port_another_server_listens_on_is_refused_not_shared(reuse_port):
    """Refused before any worker starts: a worker's own bind would join another SO_REUSEPORT listener's port."""
    port = free_port()
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(reuse_port))
        other.bind((HOST, port))
        other.listen(1)
        assert reserve_port(HOST, port) is None


def test_a_second_layer_is_refused_while_the_first_still_loads():
    """Before any worker listens, the first layer's reservation alone holds the port."""
    port = free_port()
    with reserve_port(HOST, port):
        assert reserve_port(HOST, port) is None


def test_port_zero_gives_every_worker_the_same_port():
    with reserve_port(HOST, 0) as reserved:
        port = reserved.getsockname()[1]
        assert port != 0
        [own] = bind_worker_sockets(HOST, port)
        own.close()


def test_a_worker_that_cannot_bind_exits_with_the_code_that_stops_the_supervisor():
    port = free_port()
    with socket.socket() as other:
        other.bind((HOST, port))
        other.listen(1)
        with pytest.raises(SystemExit) as exited:
            bind_worker_sockets(HOST, port)
    assert exited.value.code == STARTUP_FAILURE


@pytest.mark.parametrize("workers", [1, 2])
def test_the_layer_exits_with_the_failure_code_when_its_port_is_taken(workers):
    port = free_port()
    with socket.socket() as other:
        other.bind((HOST, port))
        other.listen(1)
        command = [sys.executable, "-m", "tritonllm.openai.app", "--tokenizer-dir", "unused", "--max-input-len", "8"]
        command += ["--max-seq-len", "16", "--workers", str(workers), "--port", str(port)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == STARTUP_FAILURE, done.stderr[-2000:]
    assert f"cannot bind {HOST}:{port}" in done.stderr


def test_one_worker_per_two_cores_from_one_to_eight():
    assert [carrier_count(cores) for cores in (1, 2, 3, 4, 8, 16, 17, 64)] == [1, 1, 1, 2, 4, 8, 8, 8]
