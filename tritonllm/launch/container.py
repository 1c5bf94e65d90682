"""The image's entrypoint (Kubernetes, `make serve ENGINE=trtllm`): build once, launch tritonserver, probe it.

python -m tritonllm.launch.container build-once -- BUILD_ARGS   build_engines.py unless already built
python -m tritonllm.launch.container launch BUILD_DIR           check the build, become tritonserver
python -m tritonllm.launch.container launch BUILD_DIR --dry-run print the command line it would run
python -m tritonllm.launch.container probe [GRPC_URL]           exit 0 when the engine answers (liveness)
python -m tritonllm.launch.container check-server               the wheel's tritonserver finds its libraries
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tritonllm.launch.pytriton_wheel import ServerError, prepare_backends, pytriton_root, server_env
from tritonllm.launch.server_command import ADMIN_KEY_FILE, CONTAINER_BINARY, admin_key, server_command
from tritonllm.launch.tritonserver import probe_engine
from tritonllm.protocol import ADMIN_KEY_ENV, DECOUPLED_ENGINE_MODEL, PORTS
from tritonllm.repository import builder
from tritonllm.repository.plan import LLM_API
from tritonllm.repository.render import stale_build
from tritonllm.trtllm import docker
from tritonllm.trtllm.engine_dir import EngineError, check_version, read_engine
from tritonllm.versions import LLM_API_RELEASES, LlmApiRelease

LLM_API_LAUNCHER = "trtllm-llmapi-launch"  # TensorRT-LLM's: tritonserver on rank 0, an LLM API worker on the others
# Where the nvidia-pytriton wheel's tritonserver gets its backend folder (pytriton_wheel.prepare_backends): the
# image's own filesystem, since the build folder may be a volume other pods share.
SERVER_WORK_DIR = Path(tempfile.gettempdir()) / "tritonllm-tritonserver"


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


def installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def check_llm_api_release(name: str, running: str | None) -> None:
    """The LLM API flavor's arguments and request mapping are written against the release the build is for
    (build_engines.py --llm-api-release), which runs only in that release's image."""
    release = docker.llm_api_release(name)
    if running == release.trtllm:
        return
    serve_there = f"serve it in {release.image} (`make trtllm-image LLM_API_RELEASE={name}` builds it)"
    if running is None:
        raise EngineError(
            f"tensorrt_llm is not installed here; the build is for TensorRT-LLM {release.trtllm}: {serve_there}"
        )
    matching = [key for key, other in LLM_API_RELEASES.items() if other.trtllm == running]
    rebuild = (
        f"rebuild for this image with `make build ENGINE={LLM_API} LLM_API_RELEASE={matching[0]}` "
        f"(build_engines.py --llm-api-release {matching[0]})"
        if matching
        else f"no release in tritonllm/versions.py is {running}"
    )
    raise EngineError(
        f"this image runs TensorRT-LLM {running}; the {LLM_API} flavor is written against {release.trtllm} for this "
        f"build (LLM API release {name}, tritonllm/versions.py): {serve_there}, or {rebuild}"
    )


def report_libraries(release: LlmApiRelease) -> None:
    """The flavor also calls xgrammar and transformers, which TensorRT-LLM is tested with at its own pins: a warning
    where the image has others; where the pins are not recorded, what the image has, for the log."""
    unrecorded = []
    for package, pinned in (("xgrammar", release.xgrammar), ("transformers", release.transformers)):
        have = installed(package) or "none"
        if pinned is None:
            unrecorded.append(f"{package} {have}")
        elif have != pinned:
            print(
                f"launch: warning: this image has {package} {have}; TensorRT-LLM {release.trtllm} pins {pinned} "
                "(tritonllm/versions.py): if NVIDIA's image ships it, correct the pin there",
                file=sys.stderr,
                flush=True,
            )
    if unrecorded:
        names = " and ".join(entry.split()[0] for entry in unrecorded)
        print(
            f"launch: TensorRT-LLM {release.trtllm}'s pins of {names} are not recorded (tritonllm/versions.py); "
            f"this image has {', '.join(unrecorded)}",
            file=sys.stderr,
            flush=True,
        )


def check_mpirun(what: str, tp_size: int, pp_size: int, target: str = "trtllm") -> None:
    """A tensor/pipeline-parallel engine runs one rank per GPU under mpirun (server_command): say so before
    starting, rather than fail with exec's "No such file or directory"."""
    if tp_size * pp_size > 1 and shutil.which("mpirun") is None:
        raise EngineError(
            f"{what} has {tp_size * pp_size} ranks (tp {tp_size} x pp {pp_size}), which run under mpirun, "
            f"but mpirun is not on PATH: run in the {target} target of ./Dockerfile (NVIDIA's TensorRT-LLM image), add "
            "the folder holding mpirun to PATH, or rebuild with --tp 1 --pp 1"
        )


def read_manifest(build_dir: Path) -> dict:
    return json.loads((build_dir / "manifest.json").read_text())


def wheel_server(manifest: dict) -> bool:
    """True where the image has no tritonserver of NVIDIA's (the TensorRT-LLM release images): the nvidia-pytriton
    wheel's is run, which ./Dockerfile installs there."""
    return (
        manifest["engine"] == LLM_API and not docker.llm_api_release(docker.release_name(manifest)).nvidia_tritonserver
    )


def wheel_binary() -> Path:
    return pytriton_root() / "tritonserver" / "bin" / "tritonserver"


def launch_command(build_dir: Path, exit_timeout: int, in_image: bool = True) -> list[str]:
    """The command line the image runs for this build: tritonserver, or mpirun with one rank per GPU. `in_image`:
    check first what the image must have (the TensorRT-LLM release, mpirun, trtllm-llmapi-launch) and prepare the
    wheel's backend folder; without it nothing is checked or written."""
    manifest = read_manifest(build_dir)
    world_size, rank_launcher = 1, []
    if manifest["engine"] == "trtllm":
        info = read_engine(Path(manifest["engine_dir"]))
        if in_image:
            check_version(info, version("tensorrt_llm"))
            check_mpirun(f"engine {info.path}", info.tp_size, info.pp_size)
        world_size = info.world_size
    elif manifest["engine"] == LLM_API:
        name = docker.release_name(manifest)
        release = docker.llm_api_release(name)
        world_size = manifest["tp_size"] * manifest["pp_size"]
        rank_launcher = [LLM_API_LAUNCHER] if world_size > 1 else []
        if in_image:
            check_llm_api_release(name, installed("tensorrt_llm"))
            report_libraries(release)
            check_mpirun(f"model {manifest['model_dir']}", manifest["tp_size"], manifest["pp_size"], release.target)
            # On the 1.4 line it is taken as present, with the same name and rank-0 behaviour: unverified, no 1.4
            # tree could be read (docs/llmapi.md names the copies that were).
            if rank_launcher and shutil.which(LLM_API_LAUNCHER) is None:
                raise EngineError(
                    f"{LLM_API_LAUNCHER} is not on PATH: TensorRT-LLM installs it; run in the {release.target} target "
                    "of ./Dockerfile, or rebuild with --tp 1 --pp 1"
                )
    binary, backend_dir = CONTAINER_BINARY, None
    if wheel_server(manifest):
        binary = wheel_binary()
        backend_dir = prepare_backends(SERVER_WORK_DIR) if in_image else SERVER_WORK_DIR / "backends"
    key = admin_key("0.0.0.0", os.environ.get(ADMIN_KEY_ENV), "launch", build_dir / ADMIN_KEY_FILE)
    if key:  # the engine model's adapter administration checks the key the administrative APIs check
        os.environ[ADMIN_KEY_ENV] = key
    return server_command(
        binary,
        build_dir / "model_repository",
        address="0.0.0.0",
        ports=PORTS,
        build_options=manifest.get("server_options", []),
        admin_key=key,
        exit_timeout=exit_timeout,
        backend_dir=backend_dir,
        world_size=world_size,
        engine_model=manifest.get("engine_model", DECOUPLED_ENGINE_MODEL),
        rank_launcher=rank_launcher,
    )


def launch(build_dir: Path, exit_timeout: int) -> None:
    """In the image: check the build, then become its command line (the wheel's tritonserver with the libraries and
    PATH it needs, pytriton_wheel.server_env; mpirun passes them on to its ranks)."""
    command = launch_command(build_dir, exit_timeout)
    if wheel_server(read_manifest(build_dir)):
        os.execvpe(command[0], command, server_env())
    else:
        os.execvp(command[0], command)


def unresolved_libraries(work_dir: Path) -> list[str]:
    """What the wheel's tritonserver, its Python backend and this Python's stub link but do not find (`ldd`), with
    the backend folder and environment the entrypoint gives them: the stub links this Python's libpython, which an
    image may lack."""
    python = prepare_backends(work_dir) / "python"
    env = server_env()
    missing = []
    for file in (wheel_binary(), python / "libtriton_python.so", python / "triton_python_backend_stub"):
        listing = subprocess.run(["ldd", str(file)], capture_output=True, text=True, env=env, check=False).stdout
        missing += [f"{file.name} needs {line.split()[0]}" for line in listing.splitlines() if "not found" in line]
    return missing


def check_server() -> int:
    """For ./Dockerfile: the image build stops where the wheel's server could not start."""
    with tempfile.TemporaryDirectory() as work:
        missing = unresolved_libraries(Path(work))
    if missing:
        print(
            f"check-server: not found: {'; '.join(missing)}: install them in the image (a libpython3.X.so.1.0 comes "
            f"with Ubuntu's libpython3.X package; this Python is {sys.version_info.major}.{sys.version_info.minor})",
            file=sys.stderr,
        )
        return 1
    print(
        f"check-server: {wheel_binary()} and its Python {sys.version_info.major}.{sys.version_info.minor} stub "
        "find every library they link",
        flush=True,
    )
    return 0


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
    commands.add_parser("check-server", help="the nvidia-pytriton wheel's tritonserver finds every library it links")
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
        except (EngineError, ServerError) as exc:
            print(f"launch: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "check-server":
        try:
            return check_server()
        except ServerError as exc:
            print(f"check-server: {exc}", file=sys.stderr)
            return 1
    problem = probe_engine(args.grpc_url)
    if problem:
        print(f"engine: {problem}", file=sys.stderr)
    return 1 if problem else 0


if __name__ == "__main__":
    raise SystemExit(main())
