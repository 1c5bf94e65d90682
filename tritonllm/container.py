"""Running the TensorRT-LLM flavor in NVIDIA's image: host checks, `docker run` and MPI command lines.

The checks run before anything slow (pulling an image, building an engine, loading one) and say
what to do. Command lines are built here as lists, so the tests can check them exactly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from tritonllm.versions import TRITON_TAG

IMAGE_TAG = f"tritonllm:trtllm-{TRITON_TAG}"  # our image, `docker build --target trtllm` of ./Dockerfile
CONTAINER_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
TRITONSERVER = "/opt/tritonserver/bin/tritonserver"


def inside_image() -> bool:
    """True inside NVIDIA's Triton images (they set this variable)."""
    return "NVIDIA_TRITON_SERVER_VERSION" in os.environ


def gpu_count(run: Callable = subprocess.run) -> int:
    """GPUs that `nvidia-smi -L` lists; 0 when there is no driver."""
    if shutil.which("nvidia-smi") is None:
        return 0
    result = run(["nvidia-smi", "-L"], capture_output=True, text=True)
    if result.returncode != 0:
        return 0
    return sum(1 for line in result.stdout.splitlines() if line.startswith("GPU "))


def host_problems(
    gpus_needed: int, docker: bool = True, run: Callable = subprocess.run, which: Callable = shutil.which
) -> list[str]:
    """What stops the TensorRT-LLM flavor from running here, each with what to do about it."""
    found = []
    if docker:
        if which("docker") is None:
            found.append(
                "Docker is not installed: the TensorRT-LLM flavor runs in NVIDIA's Triton image. Install "
                "Docker and the NVIDIA Container Toolkit, or use the portable flavor (ENGINE=portable)."
            )
        elif run(["docker", "info"], capture_output=True, text=True).returncode != 0:
            found.append(
                "Docker is installed but its daemon does not answer (`docker info` failed): start it, "
                "or add your user to the docker group."
            )
    have = gpu_count(run) if which("nvidia-smi") else 0
    if have == 0:
        found.append(
            "No NVIDIA GPU found (`nvidia-smi -L` lists none): TensorRT-LLM engines need one. "
            "On this machine use the portable flavor (ENGINE=portable)."
        )
    elif have < gpus_needed:
        found.append(
            f"The engine needs tensor x pipeline parallel = {gpus_needed} GPUs, but this host has {have}: "
            "rebuild with smaller --tp/--pp, or run on a bigger host."
        )
    return found


def docker_run(
    image: str,
    project: Path,
    command: Sequence[str],
    *,
    ports: dict[str, int] | None = None,
    host: str = "127.0.0.1",
    interactive: bool = False,
) -> list[str]:
    """`docker run` of `command` in `image`, with the project mounted at the same path (so every path
    the build wrote stays valid), all GPUs, and the shared memory and limits the Python backend and
    TensorRT-LLM need."""
    args = [
        "docker",
        "run",
        "--rm",
        "--init",
        "--gpus",
        "all",
        "--shm-size=2g",
        "--ulimit",
        "memlock=-1",
        "--ulimit",
        "stack=67108864",
        "-v",
        f"{project}:{project}",
        "-w",
        str(project),
        "-e",
        f"PYTHONPATH={project}",
    ]
    if interactive:
        args += ["-it"]
    for name, port in (ports or {}).items():
        args += ["-p", f"{host}:{port}:{CONTAINER_PORTS[name]}"]
    return [*args, image, *command]


def tritonserver_args(repository: Path, ports: dict[str, int] = CONTAINER_PORTS, address: str = "0.0.0.0") -> list[str]:
    return [
        f"--model-repository={repository}",
        f"--http-address={address}",
        f"--http-port={ports['http']}",
        f"--grpc-address={address}",
        f"--grpc-port={ports['grpc']}",
        f"--metrics-address={address}",
        f"--metrics-port={ports['metrics']}",
        "--disable-auto-complete-config",
    ]


def launch_command(
    repository: Path,
    world_size: int,
    engine_model: str = "tensorrt_llm",
    ports: dict[str, int] = CONTAINER_PORTS,
    extra: Sequence[str] = (),
) -> list[str]:
    """tritonserver, or for a multi-GPU engine one tritonserver per rank under MPI, as the
    tensorrtllm backend requires (its `launch_triton_server.py` leader mode): every rank gets its
    own Python-backend shared-memory prefix, and ranks other than 0 load only the engine model.
    `extra` options go to every rank."""
    if world_size == 1:
        return [TRITONSERVER, *tritonserver_args(repository, ports), *extra]
    command = ["mpirun", "--allow-run-as-root"]
    for rank in range(world_size):
        command += [
            "-n",
            "1",
            TRITONSERVER,
            *tritonserver_args(repository, ports),
            *extra,
            f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
        ]
        if rank:
            command += ["--model-control-mode=explicit", f"--load-model={engine_model}"]
        command.append(":")
    return command[:-1]


def build_once(build_args: list[str], build_dir: Path) -> int:
    """build_engines.py with these arguments, unless the build folder already holds their build."""
    import json

    from tritonllm import build

    stamp = build_dir / "build-args.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == build_args and (build_dir / "manifest.json").is_file():
        print(f"{build_dir} already holds this build; nothing to do", flush=True)
        return 0
    code = build.main(build_args)
    if code == 0:
        stamp.write_text(json.dumps(build_args))
    return code


def launch(build_dir: Path, exit_timeout: int) -> None:
    """In the image: check the build, then become tritonserver (or mpirun with one rank per GPU)."""
    import json
    from importlib.metadata import version

    from tritonllm.server import restricted_api_flags
    from tritonllm.trtllm_engine import check_version, read_engine

    manifest = json.loads((build_dir / "manifest.json").read_text())
    world_size = 1
    if manifest["engine"] == "trtllm":
        info = read_engine(Path(manifest["engine_dir"]))
        check_version(info, version("tensorrt_llm"))
        world_size = info.world_size
    extra = [
        f"--exit-timeout-secs={exit_timeout}",
        *manifest.get("tritonserver_args", []),
        *restricted_api_flags(os.environ.get("TRITONLLM_ADMIN_KEY")),
    ]
    command = launch_command(build_dir / "model_repository", world_size, extra=extra)
    os.execvp(command[0], command)


def main(argv: list[str] | None = None) -> int:
    """`check [GPUS]`: the host checks; `image`: the image tag (both for the Makefile). In the image
    (Kubernetes): `build-once -- ARGS` (build_engines.py unless already built), `launch BUILD_DIR`
    (start serving), `probe [GRPC_URL]` (exit 0 when the engine answers: a liveness probe)."""
    import argparse
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["image"]:
        print(IMAGE_TAG)
        return 0
    if argv[:1] == ["build-once"]:
        build_args = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        build_dir = Path(build_args[build_args.index("--build-dir") + 1])
        return build_once(build_args, build_dir)
    if argv[:1] == ["launch"]:
        parser = argparse.ArgumentParser(prog="tritonllm.container launch")
        parser.add_argument("build_dir", type=Path)
        parser.add_argument("--exit-timeout", type=int, default=60)
        args = parser.parse_args(argv[1:])
        launch(args.build_dir, args.exit_timeout)
        return 0
    if argv[:1] == ["probe"]:
        from tritonllm.server import probe_engine

        problem = probe_engine(argv[1] if len(argv) > 1 else "127.0.0.1:8001")
        if problem:
            print(f"engine: {problem}", file=sys.stderr)
        return 1 if problem else 0
    gpus = int(argv[1]) if len(argv) > 1 else 1
    problems = host_problems(gpus_needed=gpus)
    for problem in problems:
        print(f"trtllm: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
