"""Checks run before anything is installed: can this machine run the pip-packaged tritonserver?

Standard library only: it runs with the system Python, before the virtualenv exists.
"""

from __future__ import annotations

import platform
import shutil
import sys
import sysconfig
from pathlib import Path

MIN_GLIBC = (2, 35)  # the nvidia-pytriton wheel is manylinux_2_35
PYTHONS = ((3, 10), (3, 13))  # tritonserver 2.51 ships Python-backend stubs for 3.8-3.13; torch 2.13 needs >= 3.10


def llama_cpp_cflags() -> str:
    """The compiler flags llama.cpp is built with, the engine's (by the Makefile) and bench-peers' llama-server alike.

    It is compiled for the CPU it is built on, without AMX: some virtual machines report AMX and then stop a
    process that uses it with an illegal instruction (llama.cpp's AMX path serves quantized models such as the
    packaged Q4_1 one)."""
    return "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine() == "x86_64" else ""


def problems() -> list[str]:
    found = []
    version = sys.version_info[:2]
    if not PYTHONS[0] <= version <= PYTHONS[1]:
        found.append(
            f"Python {version[0]}.{version[1]} is not supported: use 3.10 to 3.13, e.g. `make build PYTHON=python3.11`."
        )
    if sys.platform != "linux" or platform.machine() != "x86_64":
        found.append(
            f"{sys.platform}/{platform.machine()}: the pip-packaged tritonserver needs Linux x86_64 "
            "(elsewhere, use the Docker image: docs/deploy.md, 'Containers')."
        )
    libc, libc_version = platform.libc_ver()
    if libc == "glibc":
        have = tuple(int(x) for x in libc_version.split(".")[:2])
        if have < MIN_GLIBC:
            found.append(
                f"glibc {libc_version} is too old: the pip-packaged tritonserver needs glibc >= 2.35 "
                "(Debian 12, Ubuntu 22.04 or newer), or use the Docker image."
            )
    libname = f"libpython{version[0]}.{version[1]}.so.1.0"
    libdirs = [sysconfig.get_config_var("LIBDIR") or "", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]
    if not any((Path(d) / libname).exists() for d in libdirs if d):
        found.append(
            f"{libname} was not found: tritonserver's Python backend links it. "
            f"Install it (Debian/Ubuntu: apt-get install libpython{version[0]}.{version[1]}), "
            "or use a Python built with --enable-shared."
        )
    if not shutil.which("c++") and not shutil.which("g++"):
        found.append(
            "no C++ compiler: llama-cpp-python (the CPU engine's runtime) is compiled at install. "
            "Install one (Debian/Ubuntu: apt-get install build-essential)."
        )
    return found


def main() -> int:
    found = problems()
    for problem in found:
        print(f"preflight: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--llama-cpp-cflags"]:  # for the Makefile
        print(llama_cpp_cflags())
        sys.exit(0)
    sys.exit(main())
