"""NVIDIA's image for the TensorRT-LLM flavor: its tag, host checks and `docker run` command lines.

The checks run before anything slow (pulling an image, building an engine, loading one) and say
what to do. Command lines are built here as lists, so the tests can check them exactly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from tritonllm.protocol import PORTS
from tritonllm.versions import TRITON_TAG

IMAGE_TAG = f"tritonllm:trtllm-{TRITON_TAG}"  # our image, `docker build --target trtllm` of ./Dockerfile


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


def mounted(project: Path, folders: Sequence[Path]) -> list[Path]:
    """The project and `folders`, less any inside another: each is mounted at its own path."""
    wanted = list(dict.fromkeys([project, *folders]))
    return [f for f in wanted if not any(f != other and f.is_relative_to(other) for other in wanted)]


def docker_run(
    image: str,
    project: Path,
    command: Sequence[str],
    *,
    folders: Sequence[Path] = (),
    ports: dict[str, int] | None = None,
    host: str = "127.0.0.1",
    interactive: bool = False,
) -> list[str]:
    """`docker run` of `command` in `image`, with the project and `folders` (absolute) mounted at the same paths
    (so every path the build wrote stays valid), all GPUs, and the shared memory and limits the Python backend and
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
        *(arg for folder in mounted(project, folders) for arg in ("-v", f"{folder}:{folder}")),
        "-w",
        str(project),
        "-e",
        f"PYTHONPATH={project}",
    ]
    if interactive:
        args += ["-it"]
    for name, port in (ports or {}).items():
        args += ["-p", f"{host}:{port}:{PORTS[name]}"]
    return [*args, image, *command]


def main(argv: list[str] | None = None) -> int:
    """`image`: the image tag; `check [GPUS]`: the host checks (both for the Makefile)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["image"]:
        print(IMAGE_TAG)
        return 0
    if argv[:1] != ["check"]:
        print("usage: python -m tritonllm.trtllm.docker image | check [GPUS]", file=sys.stderr)
        return 2
    problems = host_problems(gpus_needed=int(argv[1]) if len(argv) > 1 else 1)
    for problem in problems:
        print(f"trtllm: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
