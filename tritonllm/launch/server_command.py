"""The tritonserver command line every launcher runs, the restricted administrative APIs and their key."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tritonllm.protocol import ADMIN_HEADER, DECOUPLED_ENGINE_MODEL, PORTS, is_loopback

# In NVIDIA's images; there the server listens on the default ports (PORTS), which `docker run` publishes.
CONTAINER_BINARY = "/opt/tritonserver/bin/tritonserver"


def add_address_options(parser: argparse.ArgumentParser) -> None:
    """The host and port flags every launcher shares, with Triton's default ports (protocol.PORTS)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind or publish on (default: loopback only)")
    for api, port in PORTS.items():
        parser.add_argument(f"--{api}-port", type=int, default=port, help=f"Triton's {api} port (default: {port})")


def build_options(repository: Path) -> list[str]:
    """The server options the build recorded for this repository (BuildPlan.server_options)."""
    manifest = repository.parent / "manifest.json"
    return json.loads(manifest.read_text()).get("server_options", []) if manifest.is_file() else []


def server_command(
    binary: Path | str,
    repository: Path,
    *,
    address: str,
    ports: dict[str, int],
    build_options: Sequence[str] = (),
    admin_key: str | None = None,
    exit_timeout: int | None = None,
    backend_dir: Path | None = None,
    world_size: int = 1,
    engine_model: str = DECOUPLED_ENGINE_MODEL,
    rank_launcher: Sequence[str] = (),
) -> list[str]:
    """The tritonserver command line every launcher runs: the repository, addresses and ports, the options
    the build recorded, the restricted administrative APIs, and for a multi-GPU TensorRT-LLM engine one
    server per rank under MPI (the tensorrtllm backend's leader mode: each rank gets its own Python-backend
    shared-memory prefix, and ranks other than 0 load only the engine model: the manifest's engine_model,
    tensorrt_llm_decoupled by default, tensorrt_llm in the decoupled deployment).

    `rank_launcher` runs each rank's server, as NVIDIA's launch_triton_server.py --trtllm_llmapi_launch does for the
    LLM API model: `trtllm-llmapi-launch` starts tritonserver on rank 0 only and an LLM API worker on the others, so
    one server's LLM drives every GPU; several ranks then share a node, which Open MPI refuses without
    --oversubscribe when the node's slots are fewer."""
    args = [
        str(binary),
        f"--model-repository={repository}",
        *([f"--backend-directory={backend_dir}"] if backend_dir else []),
        *(
            f"--{api}-{what}={value}"
            for api in ("http", "grpc", "metrics")
            for what, value in (("address", address), ("port", ports[api]))
        ),
        "--disable-auto-complete-config",
        "--exit-on-error=true",
        *([f"--exit-timeout-secs={exit_timeout}"] if exit_timeout is not None else []),
        *build_options,
        *restricted_api_flags(admin_key),
    ]
    if world_size == 1:
        return args
    command = ["mpirun", "--allow-run-as-root", *(["--oversubscribe"] if rank_launcher else [])]
    for rank in range(world_size):
        command += ["-n", "1", *rank_launcher, *args, f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        if rank:
            command += ["--model-control-mode=explicit", f"--load-model={engine_model}"]
        command.append(":")
    return command[:-1]


RESTRICTED_APIS = "model-repository,shared-memory,logging,trace"
ADMIN_KEY_FILE = "admin-key"  # where a generated key is written: beside the build's model repository


def restricted_api_flags(key: str | None) -> list[str]:
    """Triton's own restricted-API options: loading/unloading models, shared memory, logging and
    tracing answer only requests that carry the key (inference, health and metadata stay open).

    tritonserver 2.51 takes the key on its command line only (no option reads it from a file or the environment), so
    any user of the host reads it with `ps`, a containerized server's too; inside a container, only that container's
    processes see it (docs/deploy.md)."""
    if not key:
        return []
    return [
        f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}={key}",
        f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}={key}",
    ]


def write_private(path: Path, text: str) -> None:
    """`text` as the file `path`, readable by this user only (0600): written to a new temporary file beside it
    (mkstemp: O_CREAT | O_EXCL, mode 0600), then renamed over it, so that no reader sees a wider mode or part of
    the text, and a link left at `path` is replaced rather than written through."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def admin_key(host: str, given: str | None, who: str, key_file: Path) -> str | None:
    """The key the administrative APIs need: the one given, or when the server listens beyond loopback, a random
    one, so that no address reachable from outside serves them open. A random key is written to `key_file`
    (readable by this user only), and only that file's path is printed (`who` says which launcher): stdout is a
    container's log."""
    if given or is_loopback(host):
        return given or None
    key = secrets.token_urlsafe(24)
    try:
        write_private(key_file, key + "\n")
    except OSError as exc:  # a read-only build folder (a mounted volume): say what to do, not a traceback
        raise SystemExit(
            f"{who}: listening on {host}, the administrative APIs need a key, and the generated one cannot be written "
            f"to {key_file} ({exc.strerror or exc}): set TRITONLLM_ADMIN_KEY to choose the key"
        ) from None
    print(
        f"{who}: listening on {host}: the administrative APIs need header {ADMIN_HEADER} with the key in {key_file} "
        "(readable by this user only; set TRITONLLM_ADMIN_KEY to choose the key)",
        flush=True,
    )
    return key
