"""The OpenAI layer's worker processes on one port: uvicorn's supervisor, each worker with a listening socket of its
own.

uvicorn binds one socket in its supervisor and hands it to every worker. Each worker's event loop then accepts as
many waiting connections as it can at once, so a burst of new connections goes to whichever worker wakes first, and
each keeps its connections: on the H200 host's 16 cores, eight workers under 512 streams ran between 0.16 and 0.97
of a core each, the busiest bounding the layer (docs/performance.md). Here every worker binds its own socket with
`SO_REUSEPORT`, and the kernel spreads new connections over the workers' sockets by their addresses.
"""

from __future__ import annotations

import socket
import sys

from uvicorn.config import STARTUP_FAILURE

APP_FACTORY = "tritonllm.openai.app:app_from_environment"  # each worker's app, made in the worker


def default_workers(cores: int) -> int:
    """One worker per four cores, at most eight: the rule of the text models' instances (repository/plan.py), but
    from one, since the engine and Triton need the cores of a small host more."""
    return max(1, min(8, cores // 4))


def _socket(host: str, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)  # uvicorn's rule for the family
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def worker_sockets(host: str, port: int) -> list[socket.socket]:
    """A worker's own socket on the port, bound with SO_REUSEPORT; the worker's server listens on it. A port that
    cannot be bound ends the worker with uvicorn's startup-failure code, which stops the supervisor too (any other
    exit and it starts the worker again, and again)."""
    sock = _socket(host, reuse_port=True)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        print(f"tritonllm.openai: cannot bind {host}:{port}: {exc}", file=sys.stderr)
        sys.exit(STARTUP_FAILURE)
    return [sock]


class WorkerSockets(list):
    """What uvicorn's supervisor hands each worker as its sockets: empty here, and rebuilt in each worker (where the
    supervisor's spawned process unpickles it) as `worker_sockets`, a socket of that worker's own."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.address = (host, port)

    def __reduce__(self):
        return worker_sockets, self.address


def reserve_port(host: str, port: int) -> socket.socket | None:
    """A socket that holds the port for the workers, or None when it is taken. First bound without SO_REUSEPORT,
    so that a port another server listens on, with SO_REUSEPORT or not, is refused here and not shared; then bound
    again with it and never listened on: it keeps the port while no worker holds it, and takes no connections."""
    with _socket(host, reuse_port=False) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            print(f"tritonllm.openai: cannot bind {host}:{port}: {exc}", file=sys.stderr)
            return None
    reserved = _socket(host, reuse_port=True)
    reserved.bind((host, port))
    return reserved


def supervise_workers(workers: int, host: str, port: int) -> int:
    """Runs `workers` processes on one port under uvicorn's supervisor, until it stops them. Its exit code:
    uvicorn's startup-failure code when the port is taken or a worker could not start (uvicorn then stops them all,
    and returns as from a clean stop, so a launcher would take the failure for a normal end), else 0."""
    from uvicorn import Config
    from uvicorn.supervisors import Multiprocess

    reserved = reserve_port(host, port)
    if reserved is None:
        return STARTUP_FAILURE
    with reserved:
        config = Config(APP_FACTORY, factory=True, workers=workers, host=host, port=port, log_level="warning")
        supervisor = Multiprocess(config, sockets=WorkerSockets(host, port))
        supervisor.run()
    return STARTUP_FAILURE if any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes) else 0
