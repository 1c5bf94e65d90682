"""The project's TensorRT-LLM images: their tags per release, host checks and `docker run` command lines.

The checks run before anything slow (pulling an image, building an engine, loading one) and say
what to do. Command lines are built here as lists, so the tests can check them exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tritonllm.protocol import PORTS
from tritonllm.trtllm.engine_dir import EngineError
from tritonllm.versions import DEFAULT_LLM_API_RELEASE, LLM_API_RELEASES, TRTLLM_VERSION, LlmApiRelease

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"
# TensorRT engines are built and served in the 1.2.1 release's image, Triton's own (tritonllm/versions.py).
ENGINE_RELEASE = LLM_API_RELEASES[TRTLLM_VERSION]
IMAGE_TAG = ENGINE_RELEASE.image  # `docker build --target trtllm` of ./Dockerfile
# Set by every target of ./Dockerfile: NVIDIA's TensorRT-LLM release images, unlike its Triton images, set no
# NVIDIA_TRITON_SERVER_VERSION.
IMAGE_MARKER = "TRITONLLM_IMAGE"


def inside_image() -> bool:
    """True inside the project's images and NVIDIA's Triton images (the project mounted into one)."""
    return IMAGE_MARKER in os.environ or "NVIDIA_TRITON_SERVER_VERSION" in os.environ


def llm_api_release(name: str) -> LlmApiRelease:
    if name not in LLM_API_RELEASES:
        raise EngineError(
            f"LLM API release {name!r} is not one this checkout knows ({', '.join(LLM_API_RELEASES)}; "
            "tritonllm/versions.py): pick one of them, e.g. `make build ENGINE=trtllm-llmapi "
            f"LLM_API_RELEASE={DEFAULT_LLM_API_RELEASE}`"
        )
    return LLM_API_RELEASES[name]


def release_name(manifest: dict) -> str:
    """The LLM API release a build is for (build_engines.py --llm-api-release); builds of other engines record none."""
    return manifest.get("llm_api_release", DEFAULT_LLM_API_RELEASE)


def served_release(engine: str, name: str | None = None) -> LlmApiRelease:
    """The release whose image serves this engine: the engine flavor's always, the LLM API flavor's as built (`name`;
    the default where None)."""
    return ENGINE_RELEASE if engine == "trtllm" else llm_api_release(name or DEFAULT_LLM_API_RELEASE)


def built_release(build_dir: Path, default: str | None) -> str | None:
    """The LLM API release the build in `build_dir` records (build_engines.py --llm-api-release), whose image
    `make serve` builds first; `default` where there is no build yet or it records none."""
    manifest = build_dir / "manifest.json"
    name = json.loads(manifest.read_text()).get("llm_api_release", default) if manifest.is_file() else default
    if name != default:
        print(
            f"trtllm: {build_dir} holds a build for LLM API release {name}: its image is the one served",
            file=sys.stderr,
        )
    return name


def image_build_args(release: LlmApiRelease, dockerfile: Path = DOCKERFILE) -> list[str]:
    """`docker build` arguments for the release's image: its target, its tag, and the ARG its target's FROM line takes
    set so that the line names the release's base image, so that tritonllm/versions.py stays the one place the
    releases are pinned; a Dockerfile that cannot name it is an error, not another base."""
    line = re.search(rf"^FROM (\S+) AS {re.escape(release.target)}$", dockerfile.read_text(), re.M)
    if line is None:
        raise EngineError(f"{dockerfile} has no target {release.target}: add it, or fix the release's target")
    template = line[1]
    arg = re.search(r"\$\{(\w+)\}", template)
    value = arg and re.fullmatch(re.escape(template).replace(re.escape(arg[0]), "(.+)"), release.base_image)
    if not value:
        raise EngineError(
            f"target {release.target} of {dockerfile} is FROM {template}, which no build argument makes "
            f"{release.base_image}: make the two agree"
        )
    return ["--target", release.target, "-t", release.image, "--build-arg", f"{arg[1]}={value[1]}"]


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
    """For the Makefile: the image's tag and `docker build` arguments, and the host checks."""
    parser = argparse.ArgumentParser(prog="python -m tritonllm.trtllm.docker", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for command, what in (("image", "the image's tag"), ("build-args", "its `docker build` arguments")):
        sub = commands.add_parser(command, help=what)
        sub.add_argument("release", nargs="?", help="an LLM API release (default: the engine flavor's image)")
        sub.add_argument("--build-dir", type=Path, help="the release this build records, where it records one")
    check = commands.add_parser("check", help="Docker and enough GPUs for tensor x pipeline parallel = GPUS")
    check.add_argument("gpus", nargs="?", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "check":
        problems = host_problems(gpus_needed=args.gpus)
        for problem in problems:
            print(f"trtllm: {problem}", file=sys.stderr)
        return 1 if problems else 0
    try:
        name = built_release(args.build_dir, args.release) if args.build_dir else args.release
        release = llm_api_release(name) if name else ENGINE_RELEASE
        print(release.image if args.command == "image" else " ".join(image_build_args(release)))
    except EngineError as exc:
        print(f"trtllm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
