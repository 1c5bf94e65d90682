"""The image's entrypoint (Kubernetes, `make serve ENGINE=trtllm`): build once, launch tritonserver, probe it.

python -m tritonllm.launch.container build-once -- BUILD_ARGS   build_engines.py unless already built
python -m tritonllm.launch.container launch BUILD_DIR           check the build, become tritonserver
python -m tritonllm.launch.container launch BUILD_DIR --dry-run print the command line it would run
python -m tritonllm.launch.container probe [GRPC_URL]           exit 0 when the engine answers (liveness)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

from tritonllm.launch.server_command import ADMIN_KEY_FILE, CONTAINER_BINARY, admin_key, server_command
from tritonllm.launch.tritonserver import probe_engine
from tritonllm.protocol import DECOUPLED_ENGINE_MODEL, PORTS
from tritonllm.repository import builder
from tritonllm.repository.plan import LLM_API
from tritonllm.repository.render import stale_build
from tritonllm.trtllm import docker
from tritonllm.trtllm.engine_dir import EngineError, check_version, read_engine
from tritonllm.versions import TRTLLM_VERSION

LLM_API_LAUNCHER = "trtllm-llmapi-launch"  # TensorRT-LLM's: tritonserver on rank 0, an LLM API worker on the others


def build_once(build_args: list[str], build_dir: Path) -> int:
    """build_engines.py with these arguments, unless the build folder already holds their build, rendered from
    this image's model templates."""
    stamp, manifest = build_dir / "build-args.json", build_dir / "manifest.json"
    built = stamp.is_file() and json.loads(stamp.read_text()) == build_args and manifest.is_file()
    if built and not stale_build(json.loads(manifest.read_text())):
        print(f"{build_dir} already holds this build; nothing to do", flush=True)
        return 0
    code = builder.main(build_args)
    if code == 0:
        stamp.write_text(json.dumps(build_args))
    return code


def check_llm_api_release(running: str) -> None:
    """The LLM API flavor's arguments and request mapping are written against the pinned release."""
    if running != TRTLLM_VERSION:
        raise EngineError(
            f"this image runs TensorRT-LLM {running}; the {LLM_API} flavor is written against {TRTLLM_VERSION} "
            f"(tritonllm/versions.py): serve in {docker.IMAGE_TAG} (`make build ENGINE={LLM_API}` builds it)"
        )


def check_mpirun(what: str, tp_size: int, pp_size: int) -> None:
    """A tensor/pipeline-parallel engine runs one rank per GPU under mpirun (server_command): say so before
    starting, rather than fail with exec's "No such file or directory"."""
    if tp_size * pp_size > 1 and shutil.which("mpirun") is None:
        raise EngineError(
            f"{what} has {tp_size * pp_size} ranks (tp {tp_size} x pp {pp_size}), which run under mpirun, "
            "but mpirun is not on PATH: run in the trtllm target of ./Dockerfile (NVIDIA's TensorRT-LLM image), add "
            "the folder holding mpirun to PATH, or rebuild with --tp 1 --pp 1"
        )


def launch_command(build_dir: Path, exit_timeout: int, in_image: bool = True) -> list[str]:
    """The command line the image runs for this build: tritonserver, or mpirun with one rank per GPU. `in_image`:
    check first what the image must have (the TensorRT-LLM release, mpirun, trtllm-llmapi-launch)."""
    manifest = json.loads((build_dir / "manifest.json").read_text())
    world_size, rank_launcher = 1, []
    if manifest["engine"] == "trtllm":
        info = read_engine(Path(manifest["engine_dir"]))
        if in_image:
            check_version(info, version("tensorrt_llm"))
            check_mpirun(f"engine {info.path}", info.tp_size, info.pp_size)
        world_size = info.world_size
    elif manifest["engine"] == LLM_API:
        world_size = manifest["tp_size"] * manifest["pp_size"]
        rank_launcher = [LLM_API_LAUNCHER] if world_size > 1 else []
        if in_image:
            check_llm_api_release(version("tensorrt_llm"))
            check_mpirun(f"model {manifest['model_dir']}", manifest["tp_size"], manifest["pp_size"])
            if rank_launcher and shutil.which(LLM_API_LAUNCHER) is None:
                raise EngineError(
                    f"{LLM_API_LAUNCHER} is not on PATH: TensorRT-LLM installs it; run in the trtllm target of "
                    "./Dockerfile, or rebuild with --tp 1 --pp 1"
                )
    return server_command(
        CONTAINER_BINARY,
        build_dir / "model_repository",
        address="0.0.0.0",
        ports=PORTS,
        build_options=manifest.get("server_options", []),
        admin_key=admin_key("0.0.0.0", os.environ.get("TRITONLLM_ADMIN_KEY"), "launch", build_dir / ADMIN_KEY_FILE),
        exit_timeout=exit_timeout,
        world_size=world_size,
        engine_model=manifest.get("engine_model", DECOUPLED_ENGINE_MODEL),
        rank_launcher=rank_launcher,
    )


def launch(build_dir: Path, exit_timeout: int) -> None:
    """In the image: check the build, then become its command line."""
    command = launch_command(build_dir, exit_timeout)
    os.execvp(command[0], command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tritonllm.launch.container",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    once = commands.add_parser("build-once", help="build_engines.py with these arguments unless already built")
    once.add_argument("build_args", nargs=argparse.REMAINDER)
    start = commands.add_parser("launch", help="check the build, then become tritonserver")
    start.add_argument("build_dir", type=Path)
    start.add_argument("--exit-timeout", type=int, default=60)
    start.add_argument(
        "--dry-run", action="store_true", help="print the command line, without the image's checks, and exit"
    )
    probe = commands.add_parser("probe", help="exit 0 when the engine answers")
    probe.add_argument("grpc_url", nargs="?", default=f"127.0.0.1:{PORTS['grpc']}")
    args = parser.parse_args(argv)
    if args.command == "build-once":
        build_args = args.build_args[1:] if args.build_args[:1] == ["--"] else args.build_args
        return build_once(build_args, builder.parse_args(build_args).build_dir)
    if args.command == "launch":
        try:
            if args.dry_run:
                print(shlex.join(launch_command(args.build_dir, args.exit_timeout, in_image=False)))
                return 0
            launch(args.build_dir, args.exit_timeout)
        except EngineError as exc:
            print(f"launch: {exc}", file=sys.stderr)
            return 1
        return 0
    problem = probe_engine(args.grpc_url)
    if problem:
        print(f"engine: {problem}", file=sys.stderr)
    return 1 if problem else 0


if __name__ == "__main__":
    raise SystemExit(main())
