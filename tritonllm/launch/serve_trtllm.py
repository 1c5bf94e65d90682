"""`make serve ENGINE=trtllm`: serve the TensorRT-LLM flavor in NVIDIA's image.

On the host it checks everything that would otherwise fail late (build present, engine complete
and from the pinned TensorRT-LLM release, tokenizer present, Docker, enough GPUs), then runs
itself in the image; in the image it checks the engine against the installed release and starts
tritonserver, one rank per GPU under MPI when the engine is tensor/pipeline parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tritonllm.launch import container
from tritonllm.launch.server_command import add_address_options
from tritonllm.repository.render import stale_build
from tritonllm.trtllm import docker
from tritonllm.trtllm.engine_dir import EngineError, EngineInfo, check_version, read_engine
from tritonllm.versions import TRTLLM_VERSION


def load_build(build_dir: Path) -> EngineInfo:
    manifest_path = build_dir / "manifest.json"
    if not manifest_path.is_file():
        raise EngineError(f"{manifest_path} is missing: run `make build ENGINE=trtllm` first")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("engine") != "trtllm":
        raise EngineError(f"{build_dir} holds a {manifest.get('engine')} build: run `make build ENGINE=trtllm`")
    if not any(Path(manifest["tokenizer_dir"]).glob("tokenizer*")):
        raise EngineError(
            f"tokenizer folder {manifest['tokenizer_dir']} is missing or empty: run `make build ENGINE=trtllm`"
        )
    if why := stale_build(manifest):
        raise EngineError(f"{build_dir}: {why}: run `make build ENGINE=trtllm` again")
    return read_engine(Path(manifest["engine_dir"]))


def build_folders(build_dir: Path) -> list[Path]:
    """The folders the rendered configs name by absolute path: the build (its model repository and guided decoding's
    tokenizer file), the engine (gpt_model_path) and the tokenizer (pre/postprocessing). `docker run` mounts each at
    the same path: an engine or build folder outside the project would otherwise be missing in the container."""
    manifest = json.loads((build_dir / "manifest.json").read_text())
    return [build_dir, Path(manifest["engine_dir"]), Path(manifest["tokenizer_dir"])]


def installed_trtllm() -> str:
    try:
        return version("tensorrt_llm")
    except PackageNotFoundError:
        raise EngineError(
            "tensorrt_llm is not installed in this image: use the trtllm target of ./Dockerfile"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build-dir", type=Path, default=Path("build"))
    add_address_options(parser)
    parser.add_argument("--exit-timeout", type=int, default=60, help="seconds the server waits for requests in flight")
    args = parser.parse_args(argv)
    build_dir = args.build_dir.resolve()
    try:
        info = load_build(build_dir)
        where = f"TensorRT-LLM {info.version}, tp {info.tp_size} x pp {info.pp_size}"
        if docker.inside_image():
            check_version(info, installed_trtllm())
            print(f"Serving {info.path} ({where})", flush=True)
            container.launch(build_dir, exit_timeout=args.exit_timeout)  # becomes tritonserver, as the entrypoint does
            return 0
        check_version(info, TRTLLM_VERSION)
        problems = docker.host_problems(gpus_needed=info.world_size)
        if problems:
            raise EngineError("\n  ".join(["cannot serve the TensorRT-LLM flavor here:", *problems]))
        if subprocess.run(["docker", "image", "inspect", docker.IMAGE_TAG], capture_output=True).returncode:
            raise EngineError(f"image {docker.IMAGE_TAG} is missing: run `make build ENGINE=trtllm`")
    except EngineError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    ports = {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    inner = ["python3", "-m", "tritonllm.launch.serve_trtllm", "--build-dir", str(build_dir)]
    folders = build_folders(build_dir)
    command = docker.docker_run(docker.IMAGE_TAG, Path.cwd(), inner, folders=folders, ports=ports, host=args.host)
    print(f"Serving {info.path} ({where}) in {docker.IMAGE_TAG}: {' '.join(command)}", flush=True)
    os.execvp(command[0], command)  # docker takes over this process and its signals
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
