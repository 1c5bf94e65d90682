"""The `tritonserver` 2.51 binary shipped in the `nvidia-pytriton` wheel, run without Docker.

Only the binary is used, not PyTriton's API. Its Python backend needs a stub built for this
Python version next to `libtriton_python.so`, the wheel's bundled libraries and the interpreter's
libpython on LD_LIBRARY_PATH (libpython's folder only where the loader would not find it), and this
environment's `bin/` first on PATH so that the stub imports this environment's packages (numpy,
torch, transformers, tritonllm).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tritonllm.errors import TritonLLMError


class ServerError(TritonLLMError, RuntimeError):
    """tritonserver cannot start, or stopped; the message says why and what to do."""


def pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("The nvidia-pytriton wheel (which carries tritonserver) is not installed: run `make build`.")
    return Path(next(iter(spec.submodule_search_locations)))


def prepare_backends(work_dir: Path) -> Path:
    """A backend folder whose Python backend has the stub for this interpreter; returns it."""
    server_root = pytriton_root() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server_root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"tritonserver's Python backend has no stub for Python {version}; use Python 3.8 to 3.13.")
    python_backend = work_dir / "backends" / "python"
    python_backend.mkdir(parents=True, exist_ok=True)
    # Written aside, then renamed into place: a server already running from this folder keeps its files.
    for item in (server_root / "backends" / "python").iterdir():
        if item.is_file():
            staged = python_backend / f".{item.name}.{os.getpid()}"
            staged.unlink(missing_ok=True)
            staged.symlink_to(item)
            os.replace(staged, python_backend / item.name)
    staged = python_backend / f".{stub.name}.{os.getpid()}"
    shutil.copy2(stub, staged)
    staged.chmod(0o755)
    os.replace(staged, python_backend / stub.name)
    return work_dir / "backends"


def loader_dirs() -> set[Path]:
    """The directories of the dynamic loader's cache (resolved): searched without LD_LIBRARY_PATH."""
    try:
        listing = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return set()
    return {Path(line.rsplit("=> ", 1)[1]).parent.resolve() for line in listing.splitlines() if "=> " in line}


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    libs = [str(pytriton_root().parent / "nvidia_pytriton.libs")]  # hashed names: they shadow nothing
    libdir = sysconfig.get_config_var("LIBDIR")
    # The stub links this interpreter's libpython. Its folder goes on LD_LIBRARY_PATH only when the
    # loader would not search it anyway: LD_LIBRARY_PATH outranks the RUNPATH through which pip's
    # CUDA libraries find each other, so a system folder there (with the image's own cuDNN) gave
    # torch in the engine's stub a mix of two cuDNN releases and no cuDNN attention: served steps
    # ran much slower than in-process on a GPU.
    if libdir and Path(libdir).resolve() not in loader_dirs():
        libs.insert(0, libdir)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
