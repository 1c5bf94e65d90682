"""The checks and settings the Makefile takes from the system Python before the virtualenv exists."""

import platform
import subprocess
import sys

from tests.conftest import ROOT
from tritonllm.launch.preflight import llama_cpp_cflags


def test_llama_cpp_is_compiled_without_amx_for_the_makefile_and_bench_peers():
    printed = subprocess.run(
        [sys.executable, "-m", "tritonllm.launch.preflight", "--llama-cpp-cflags"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert printed == llama_cpp_cflags()
    if platform.machine() == "x86_64":
        assert set(printed.split()) == {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"}
    make = subprocess.run(
        ["make", "-n", "-W", "requirements.txt", ".venv/.installed"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert f'CFLAGS="{printed}" CXXFLAGS="{printed}"' in make
