"""The OpenAI layer's worker processes on one port: uvicorn's supervisor, each worker with a listening socket of its
own.

uvicorn binds one socket in its supervisor and hands it to every worker. Each worker's event loop then accepts as
many waiting connections as it can at once, so a burst of new connections goes to whichever worker wakes first, and
each keeps its connections: under many streams some workers run full while others idle (docs/performance.md,
"Several engine-model instances"). Here every worker binds its own socket with `SO_REUSEPORT`, and the kernel
spreads new connections over the workers' sockets by a hash of their addresses.

The cost: a worker's waiting connections are its own, so a worker that exits (a crash, a restart on SIGHUP) resets
the connections queued for it that it has not accepted; Linux 5.14 and later hand them to another worker with
`net.ipv4.tcp_migrate_req=1`.
"""

from __future__ import annotations

import errno
import socket
import sys

from uvicorn.config import STARTUP_FAILURE

from tritonllm.protocol import bound_socket

APP_FACTORY = "tritonllm.openai.app:app_from_environment"  # each worker's app, made in the worker


def _bound(host: str, port: int, reuse_addr: bool, reuse_port: bool) -> socket.socket | None:
    """`bound_socket`, or None (said on stderr) when it cannot be bound."""
    try:
        return bound_socket(host, port, reuse_addr, reuse_port)
    except OSError as exc:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        hint = (
            " (another server listens there: stop it, or give another --port)" if exc.errno == errno.EADDRINUSE else ""
        )
        print(f"tritonllm.openai: cannot bind {where}: {exc}{hint}", file=sys.stderr)
        return None


def bind_worker_sockets(host: str, port: int) -> list[socket.socket]:
    """A worker's own socket on the port, bound with SO_REUSEPORT (and SO_REUSEADDR, so that the connections its
    predecessors closed do not hold the port); the worker's server listens on it once its app is loaded. A port that
    cannot be bound ends the worker with uvicorn's startup-failure code: a worker the supervisor keeps alive then
    stops it, where any other exit would have it started again, and again."""
    sock = _bound(host, port, reuse_addr=True, reuse_port=True)
    if sock is None:
        sys.exit(STARTUP_FAILURE)
    return [sock]


class WorkerSockets(list):
    """What uvicorn's supervisor hands each worker as its sockets: empty here, and rebuilt in each worker (where the
    supervisor's spawned process unpickles it) by `bind_worker_sockets`, as a socket of that worker's own."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.address = (host, port)

    def __reduce__(self):
        return bind_worker_sockets, self.address


def port_free(host: str, port: int) -> bool:
    """Whether no other socket listens on the port (said on stderr when one does): bound without SO_REUSEPORT, so a
    listener with it or without it is found."""
    probe = _bound(host, port, reuse_addr=True, reuse_port=False)
    if probe is not None:
        probe.close()
    return probe is not None


def reserve_port(host: str, port: int) -> socket.socket | None:
    """A socket that holds the port for the workers, or None when it is taken. The port is first bound without
    SO_REUSEPORT (as `port_free` does), so that one another server listens on is refused here and not shared; then
    with SO_REUSEPORT alone, never listened on, so it takes no connections. It keeps the port from every other socket
    but a later SO_REUSEPORT one of the same user; without SO_REUSEADDR it fails the check of another layer starting
    on the port, which a socket that does not listen yet would pass."""
    probe = _bound(host, port, reuse_addr=True, reuse_port=False)
    if probe is None:
        return None
    with probe:
        port = probe.getsockname()[1]  # port 0: the system's choice, then the same port for every worker
    return _bound(host, port, reuse_addr=False, reuse_port=True)


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
        port = reserved.getsockname()[1]
        config = Config(APP_FACTORY, factory=True, workers=workers, host=host, port=port, log_level="warning")
        supervisor = Multiprocess(config, sockets=WorkerSockets(host, port))
        supervisor.run()
    return STARTUP_FAILURE if any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes) else 0
