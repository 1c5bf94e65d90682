"""`make serve ENGINE=trtllm` (or trtllm-llmapi): serve a TensorRT-LLM flavor in the project's image of its release.

On the host it checks everything that would otherwise fail late (build present, engine complete
and from the pinned TensorRT-LLM release, tokenizer present, Docker, enough GPUs), then runs
itself in the image of the build's release (the engine flavor's is 1.2.1's; an LLM API build records
its own); in the image it checks the build against the installed release and starts
tritonserver, one rank per GPU under MPI when the engine is tensor/pipeline parallel (the LLM API
flavor's ranks under `trtllm-llmapi-launch`: tritonllm/launch/server_command.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tritonllm.launch import container
from tritonllm.launch.pytriton_wheel import ServerError
from tritonllm.launch.server_command import add_address_options
from tritonllm.repository.plan import LLM_API
from tritonllm.repository.render import stale_build
from tritonllm.trtllm import docker
from tritonllm.trtllm.engine_dir import EngineError, EngineInfo, check_version, read_engine

TRTLLM_FLAVORS = ("trtllm", LLM_API)


@dataclass(frozen=True)
class ServedBuild:
    """A TensorRT-LLM flavor's build, as serving it needs it."""

    engine: str  # "trtllm" or LLM_API
    version: str  # the TensorRT-LLM release it runs under
    image: str  # the project's image it is served in
    world_size: int  # GPUs: tensor x pipeline parallel
    what: str  # for the log
    # The folders the rendered configs name by absolute path: the build (its model repository and guided decoding's
    # tokenizer file), the engine or checkpoint, and the tokenizer. `docker run` mounts each at the same path: one
    # outside the project would otherwise be missing in the container.
    folders: tuple[Path, ...]
    engine_info: EngineInfo | None = None  # the TensorRT engine's, checked against the installed release
    llm_api_release: str | None = None  # an LLM API build's release (versions.LLM_API_RELEASES), checked likewise


def load_build(build_dir: Path) -> ServedBuild:
    manifest_path = build_dir / "manifest.json"
    if not manifest_path.is_file():
        raise EngineError(f"{manifest_path} is missing: run `make build ENGINE=trtllm` first")
    manifest = json.loads(manifest_path.read_text())
    engine = manifest.get("engine")
    if engine not in TRTLLM_FLAVORS:
        raise EngineError(f"{build_dir} holds a {engine} build: run `make build ENGINE=trtllm` (or {LLM_API})")
    rebuild = f"make build ENGINE={engine}"
    if not any(Path(manifest["tokenizer_dir"]).glob("tokenizer*")):
        raise EngineError(f"tokenizer folder {manifest['tokenizer_dir']} is missing or empty: run `{rebuild}`")
    if why := stale_build(manifest):
        raise EngineError(f"{build_dir}: {why}: run `{rebuild}` again")
    tokenizer = Path(manifest["tokenizer_dir"])
    if engine == LLM_API:  # the checkpoint is the tokenizer's folder
        name = docker.release_name(manifest)
        release = docker.llm_api_release(name)
        tp, pp = manifest["tp_size"], manifest["pp_size"]
        where = f"TensorRT-LLM {release.trtllm} LLM API, tp {tp} x pp {pp}"
        folders = (build_dir, tokenizer)
        return ServedBuild(
            engine, release.trtllm, release.image, tp * pp, f"{tokenizer} ({where})", folders, None, name
        )
    info = read_engine(Path(manifest["engine_dir"]))
    where = f"{info.path} (TensorRT-LLM {info.version}, tp {info.tp_size} x pp {info.pp_size})"
    folders = (build_dir, info.path, tokenizer)
    return ServedBuild(engine, info.version, docker.IMAGE_TAG, info.world_size, where, folders, info)


def installed_trtllm() -> str:
    try:
        return version("tensorrt_llm")
    except PackageNotFoundError:
        raise EngineError(
            "tensorrt_llm is not installed in this image: use a TensorRT-LLM target of ./Dockerfile "
            "(`make trtllm-image` builds it)"
        ) from None


def check_release(build: ServedBuild, running: str) -> None:
    """A TensorRT engine runs only under the release that built it; an LLM API build is written against the release
    it was built for (container.check_llm_api_release)."""
    if build.engine_info is not None:
        check_version(build.engine_info, running)
    else:
        container.check_llm_api_release(build.llm_api_release, running)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build-dir", type=Path, default=Path("build"))
    add_address_options(parser)
    parser.add_argument("--exit-timeout", type=int, default=60, help="seconds the server waits for requests in flight")
    args = parser.parse_args(argv)
    build_dir = args.build_dir.resolve()
    try:
        build = load_build(build_dir)
        if docker.inside_image():
            check_release(build, installed_trtllm())
            print(f"Serving {build.what}", flush=True)
            container.launch(build_dir, exit_timeout=args.exit_timeout)  # becomes tritonserver, as the entrypoint does
            return 0
        # What the image will run: its release as tritonllm/versions.py locks it.
        check_release(build, docker.served_release(build.engine, build.llm_api_release).trtllm)
        problems = docker.host_problems(gpus_needed=build.world_size)
        if problems:
            raise EngineError("\n  ".join([f"cannot serve the {build.engine} flavor here:", *problems]))
        if subprocess.run(["docker", "image", "inspect", build.image], capture_output=True).returncode:
            make = (
                "make build ENGINE=trtllm"
                if build.engine == "trtllm"
                else f"make trtllm-image LLM_API_RELEASE={build.llm_api_release}"
            )
            raise EngineError(f"image {build.image} is missing: run `{make}`")
    except (EngineError, ServerError) as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    ports = {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    inner = ["python3", "-m", "tritonllm.launch.serve_trtllm", "--build-dir", str(build_dir)]
    command = docker.docker_run(build.image, Path.cwd(), inner, folders=build.folders, ports=ports, host=args.host)
    print(f"Serving {build.what} in {build.image}: {' '.join(command)}", flush=True)
    os.execvp(command[0], command)  # docker takes over this process and its signals
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
