"""A `tritonserver` process from the `nvidia-pytriton` wheel (pytriton_wheel.py) on a built repository, the
OpenAI layer's process beside it, and what launchers, tests and benchmarks ask of a running server: readiness,
the engine's health probe, metrics, free ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tritonllm.launch.pytriton_wheel import ServerError, prepare_backends, pytriton_root, server_env
from tritonllm.launch.server_command import build_options, server_command
from tritonllm.openai.settings import Settings
from tritonllm.protocol import (
    ADMIN_KEY_ENV,
    ENGINE_MODEL,
    HEALTH_PROBE_ID,
    infer_inputs,
    port_in_use,
    stop_request_tensors,
)


def metric_samples(text: str, prefix: str = "tritonllm_") -> dict[str, float]:
    """The samples of Prometheus text whose name starts with `prefix`, keyed by their name and labels."""
    return {
        key: float(value)
        for key, value in (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(prefix))
    }


def metric_value(samples: dict[str, float], name: str, **labels) -> float:
    """The sum of `name`'s samples that carry all of `labels`."""
    return sum(
        v for k, v in samples.items() if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items())
    )


@dataclass
class TritonServer:
    repository: Path
    work_dir: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"
    log_file: Path | None = None  # None: inherit this process's stdout/stderr
    admin_key: str | None = None  # when set, the administrative APIs need header tritonllm-admin-key: <key>

    process: subprocess.Popen | None = None

    @classmethod
    def on_free_ports(cls, build_dir: Path, log_file: Path | None = None) -> TritonServer:
        """A server for build_dir's repository on ports nothing uses (tests, benchmarks)."""
        return cls(
            build_dir / "model_repository",
            build_dir / "tritonserver",
            free_port(),
            free_port(),
            free_port(),
            log_file=log_file,
        )

    def command(self) -> list[str]:
        return server_command(
            pytriton_root() / "tritonserver" / "bin" / "tritonserver",
            self.repository,
            address=self.host,
            ports={"http": self.http_port, "grpc": self.grpc_port, "metrics": self.metrics_port},
            build_options=build_options(self.repository),
            admin_key=self.admin_key,
            backend_dir=prepare_backends(self.work_dir),
        )

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    def start(self, timeout: float = 300.0) -> None:
        if not (self.repository / "ensemble" / "config.pbtxt").is_file():
            raise ServerError(f"{self.repository} holds no rendered model repository: run `make build` first.")
        for port in (self.http_port, self.grpc_port, self.metrics_port):
            if port_in_use(self.host, port):
                raise ServerError(
                    f"port {port} on {self.host} is already in use (another server?). Stop it or choose other ports: "
                    "make serve HTTP_PORT=... GRPC_PORT=... METRICS_PORT=..."
                )
        output = open(self.log_file, "w") if self.log_file else None  # noqa: SIM115 (closed in stop)
        self._output = output
        env = server_env()
        env.pop(ADMIN_KEY_ENV, None)  # the engine model checks the key Triton's administrative APIs check, or none
        if self.admin_key:
            env[ADMIN_KEY_ENV] = self.admin_key
        self.process = subprocess.Popen(
            self.command(),
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            start_new_session=True,
        )
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                where = f" (see {self.log_file})" if self.log_file else ""
                raise ServerError(
                    f"tritonserver exited with code {self.process.returncode} while loading models{where}"
                )
            if self.is_ready():
                return
            time.sleep(0.5)
        raise ServerError(f"tritonserver was not ready after {timeout:.0f} s")

    def is_ready(self) -> bool:
        return http_ready(self.http_url)

    def metrics(self, timeout: float = 10.0) -> str:
        """The metrics port's Prometheus text."""
        with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/metrics", timeout=timeout) as response:
            return response.read().decode()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT (Triton drains and unloads models), then SIGKILL of the whole group if it hangs."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if getattr(self, "_output", None):
            self._output.close()
        return self.process.returncode

    def kill(self) -> None:
        """At once, without draining: for a server whose engine is gone."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if getattr(self, "_output", None):
            self._output.close()
            self._output = None

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def probe_engine(grpc_url: str, engine_model: str = ENGINE_MODEL, timeout: float = 10.0) -> str | None:
    """None if the engine answers healthy; else why not. The probe is TensorRT-LLM's `stop` request for an id no
    request has, which the engine model answers from the engine's health (tritonllm/engine/health.py: its loop runs,
    a busy engine's steps go on, an idle one generates a token); sent to tensorrt_llm, it reaches the engine in
    either deployment (by default through its request/response face, which forwards it)."""
    import queue

    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    inputs = infer_inputs(grpcclient, stop_request_tensors())
    try:
        with grpcclient.InferenceServerClient(grpc_url) as triton:
            triton.start_stream(callback=lambda result, error: answers.put(error))
            try:
                triton.async_stream_infer(
                    engine_model, inputs, request_id=HEALTH_PROBE_ID, enable_empty_final_response=True
                )
                error = answers.get(timeout=timeout)
            finally:
                triton.stop_stream()
    except queue.Empty:
        return f"no answer in {timeout:.0f} s"
    except Exception as exc:
        return str(exc)
    return None if error is None else error.message()


def http_ready(http_url: str) -> bool:
    """Whether a Triton server answers ready on `http_url` (host:port)."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class OpenAIFrontend:
    """The OpenAI-compatible layer (tritonllm.openai.app) as a process beside tritonserver."""

    grpc_url: str
    tokenizer_dir: str
    max_input_len: int
    max_seq_len: int
    port: int = 9000
    host: str = "127.0.0.1"
    api_key: str | None = None
    model_name: str | None = None
    log_file: Path | None = None
    kv_cache_block_tokens: int = 1
    tokenizer_class: str = ""
    workers: int | None = None  # its processes on the port; None: tritonllm.openai.app's default for the cores
    repository: str = ""  # the built repository: the direct path to the engine model (portable flavor)
    trtllm: bool = False  # a TensorRT-LLM engine: requests carry none of the portable engine's additions
    adapters: tuple[str, ...] = ()  # the build's LoRA adapters' names, each a model clients may name
    lora_admin: bool = False  # the build loads adapters while serving (--lora-dir)
    admin_key: str | None = None  # what loading and unloading them needs (the server's admin key)

    process: subprocess.Popen | None = None

    @classmethod
    def for_build(cls, grpc_url: str, manifest: dict, port: int, **options) -> OpenAIFrontend:
        """The layer for a build's model (its tokenizer, limits and engine, as Settings.from_manifest reads
        manifest.json) in front of `grpc_url`."""
        settings = Settings.from_manifest(manifest, grpc_url, options.pop("repository", ""))
        return cls(
            grpc_url,
            settings.tokenizer_dir,
            settings.max_input_len,
            settings.max_seq_len,
            port,
            kv_cache_block_tokens=settings.kv_cache_block_tokens,
            tokenizer_class=settings.tokenizer_class,
            repository=settings.repository,
            trtllm=not settings.engine_additions,
            adapters=settings.adapters,
            lora_admin=settings.lora_admin,
            **options,
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.tokenizer_dir).name

    def start(self, timeout: float = 120.0) -> None:
        if port_in_use(self.host, self.port):
            raise ServerError(f"port {self.port} on {self.host} is already in use: choose another, OPENAI_PORT=...")
        command = [
            sys.executable,
            "-m",
            "tritonllm.openai.app",
            "--grpc-url",
            self.grpc_url,
            "--tokenizer-dir",
            self.tokenizer_dir,
            "--max-input-len",
            str(self.max_input_len),
            "--max-seq-len",
            str(self.max_seq_len),
            "--kv-cache-block-tokens",
            str(self.kv_cache_block_tokens),
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.model_name:
            command += ["--model-name", self.model_name]
        if self.tokenizer_class:
            command += ["--tokenizer-class", self.tokenizer_class]
        if self.workers is not None:
            command += ["--workers", str(self.workers)]
        if self.repository:
            command += ["--repository", self.repository]
        if self.trtllm:
            command.append("--trtllm")
        for adapter in self.adapters:
            command += ["--adapter", adapter]
        if self.lora_admin:
            command.append("--lora-admin")
        env = dict(os.environ, TRITONLLM_API_KEY=self.api_key or "")
        env.pop(ADMIN_KEY_ENV, None)
        if self.admin_key:
            env[ADMIN_KEY_ENV] = self.admin_key
        output = open(self.log_file, "w") if self.log_file else None  # noqa: SIM115 (closed in stop)
        self._output = output
        self.process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT if output else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"the OpenAI-compatible layer exited with code {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise ServerError(f"the OpenAI-compatible layer did not answer on {self.url} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if getattr(self, "_output", None):
            self._output.close()
