"""`tritonllm dynamo-fleet`: a Dynamo fleet on one machine: Dynamo's frontend (OpenAI API, router) and workers.

Each worker is `tritonllm dynamo-worker` with its own tritonserver on ports of its own. Discovery is Dynamo's file
store (a folder the frontend and workers share, $DYN_FILE_KV), requests travel on Dynamo's TCP request plane and KV
events on its ZeroMQ event plane, so nothing else (etcd, NATS) is needed on one machine. The tests, the fleet
benchmark (benchmarks/fleet.py) and a user trying a fleet start it the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil  # accelerate's dependency, so every install has it

from tritonllm.launch.pytriton_wheel import ServerError
from tritonllm.launch.tritonserver import free_port, metric_samples

ROUTER_MODES = ("kv", "round-robin", "random", "least-loaded")


def fleet_env(store: Path) -> dict[str, str]:
    """The environment every process of one fleet shares: its file store, Dynamo's request and event planes."""
    return dict(
        os.environ,
        DYN_DISCOVERY_BACKEND="file",
        DYN_FILE_KV=str(store),
        DYN_REQUEST_PLANE="tcp",
        DYN_EVENT_PLANE="zmq",
        DYN_SELF_HOST_METADATA="0",  # the model card in the shared store: no system port per process
        PYTHONUNBUFFERED="1",
    )


@dataclass
class Process:
    """A process of the fleet, its output in `log`."""

    command: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen | None = None

    def start(self) -> None:
        output = open(self.log, "w")  # noqa: SIM115 (the child holds it; closed when the file object goes)
        # A session of its own: stopping it stops what it started (a worker's tritonserver) with it.
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_for(self, text: str, timeout: float) -> None:
        """Until `text` appears in the log; ServerError if the process exits or the time runs out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log.read_text(errors="replace"):
                return
            if self.process is not None and self.process.poll() is not None:
                raise ServerError(f"{self.command[2]} exited with {self.process.returncode} (see {self.log})")
            time.sleep(0.3)
        raise ServerError(f"{self.command[2]} did not say {text!r} in {timeout:.0f} s (see {self.log})")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (Dynamo drains and unregisters, the worker stops its server), then SIGKILL of its session."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """At once, with every process it started (a worker's tritonserver runs in a session of its own): a worker
        that dies."""
        if self.process is None or self.process.poll() is not None:
            return
        parent = psutil.Process(self.process.pid)
        for process in [parent, *parent.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        self.process.wait()


@dataclass
class Worker(Process):
    host: str = "127.0.0.1"
    ports: dict[str, int] = field(default_factory=dict)

    def metrics(self, prefix: str = "tritonllm_") -> dict[str, float]:
        """Its server's metrics whose names start with `prefix` (prefix-cache hits, requests), by name and labels."""
        url = f"http://{self.host}:{self.ports['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return metric_samples(response.read().decode(), prefix)


class Fleet:
    """A frontend and workers of one build, on loopback ports nothing uses."""

    def __init__(
        self, build_dir: Path, logs: Path, router_mode: str = "kv", migration_limit: int = 3, http_port: int = 0
    ) -> None:
        self.build_dir, self.logs = Path(build_dir), Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.store = Path(tempfile.mkdtemp(prefix="dynamo-store-", dir=self.logs))
        self.env = fleet_env(self.store)
        self.http_port = http_port or free_port()
        self.workers: list[Worker] = []
        command = [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1"]
        command += ["--http-port", str(self.http_port), "--router-mode", router_mode]
        command += ["--migration-limit", str(migration_limit)]
        self.frontend = Process(command, self.env, self.logs / "frontend.log")
        manifest = json.loads((self.build_dir / "manifest.json").read_text())
        self.model = Path(manifest["tokenizer_dir"]).name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, workers: int, timeout: float = 600.0) -> None:
        self.frontend.start()
        self.frontend.wait_for("Starting HTTP", timeout=60)
        started = [self.add_worker(wait=False) for _ in range(workers)]
        for worker in started:
            worker.wait_for("Serving ", timeout)
        deadline = time.monotonic() + 60
        while not self.listed():  # the frontend learns of the model from the store a moment later
            if time.monotonic() > deadline:
                raise ServerError(f"the frontend does not list {self.model} (see {self.frontend.log})")
            time.sleep(0.3)

    def listed(self) -> bool:
        """Whether the frontend serves the workers' model."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as response:
                return any(m["id"] == self.model for m in json.loads(response.read())["data"])
        except OSError:
            return False

    def add_worker(self, wait: bool = True, timeout: float = 600.0) -> Worker:
        """One more worker (it joins the running fleet); `wait`: until it serves."""
        ports = {name: free_port() for name in ("http", "grpc", "metrics")}
        command = [sys.executable, "-m", "tritonllm.dynamo.worker", "--build-dir", str(self.build_dir)]
        for name, port in ports.items():
            command += [f"--{name}-port", str(port)]
        log = self.logs / f"worker-{len(self.workers)}.log"
        worker = Worker(command, self.env, log, ports=ports)
        worker.start()
        self.workers.append(worker)
        if wait:
            worker.wait_for("Serving ", timeout)
        return worker

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.frontend.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--build-dir", type=Path, default=Path("build"), help="the build every worker serves")
    parser.add_argument("--workers", type=int, default=2, help="workers to start (default: 2)")
    parser.add_argument("--http-port", type=int, default=8080, help="the frontend's OpenAI API port (default: 8080)")
    parser.add_argument("--router-mode", choices=ROUTER_MODES, default="kv", help="Dynamo's router (default: kv)")
    parser.add_argument("--logs", type=Path, help="where the processes' logs go (default: BUILD_DIR/dynamo-fleet)")
    args = parser.parse_args(argv)
    logs = args.logs or args.build_dir / "dynamo-fleet"
    fleet = Fleet(args.build_dir, logs, args.router_mode, http_port=args.http_port)
    try:
        print(f"Starting Dynamo's frontend and {args.workers} workers (logs: {fleet.logs}) ...", flush=True)
        fleet.start(args.workers)
        print(f"Ready: the OpenAI API on {fleet.url}/v1, model `{fleet.model}`; Ctrl-C stops the fleet.", flush=True)
        while fleet.frontend.process.poll() is None:
            time.sleep(1)
        return 1
    except ServerError as exc:
        print(f"dynamo-fleet: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        fleet.stop()


if __name__ == "__main__":
    sys.exit(main())
