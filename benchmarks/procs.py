"""The server's processes as the benchmarks see them: stub discovery, CPU seconds, liveness, py-spy profiles."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from tritonllm.protocol import DECOUPLED_ENGINE_MODEL, ENGINE_MODEL, STREAMING_MODEL


def stub_pids() -> list[tuple[str, str]]:
    """(model, pid) of every Python-backend stub process on this machine, and ("engine_process", pid) of the
    engine's own process (tritonllm/engine/process.py) where it runs apart from its stub."""
    lines = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    # A stub's arguments start with its model file: .../<model>/<version>/model.py
    stubs = [(line.split()[2].split("/")[-3], line.split()[0]) for line in lines if "python_backend_stub " in line]
    return stubs + [("engine_process", line.split()[0]) for line in lines if "-m tritonllm.engine.process" in line]


def cpu_seconds(pid: int | str) -> float:
    """CPU seconds (user + system) a process has used so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int | str) -> list[int]:
    """The processes `pid` started (its threads' children)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").glob("*") for c in (task / "children").read_text().split()]


def alive(pid: int | str) -> bool:
    """Not gone and not a zombie (a stub that died stays <defunct> under tritonserver, which does not notice)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


SPY_OPTIONS: list[str] = ["--nonblocking", "--rate", "200"]  # py-spy options for every profile


@contextlib.contextmanager
def profiled(
    out: Path | None,
    label: str,
    seconds: int,
    pids: list[tuple[str, str]] | None = None,
    gil: bool = False,
    waits: bool = False,
):
    """py-spy on `pids` ((name, pid); default: the engine's and the streaming model's stubs) while the block
    runs, and the shared libraries each process has loaded (a stub embeds its own libpython). With `gil`, only
    the samples of a thread holding the GIL: their count over `seconds` x the rate is how busy the GIL was. With
    `waits`, every thread's samples, waiting ones too, down to their native frames (py-spy --idle --native, which
    pauses the process for each sample: 50 a second): a wait called from Python code itself is one for the GIL."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    if pids is None:
        pids = [
            (m, pid)
            for m, pid in stub_pids()
            if m in (ENGINE_MODEL, DECOUPLED_ENGINE_MODEL, STREAMING_MODEL, "engine_process")
        ]
    spies = []
    for name, pid in pids:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        (out / f"{label}-{name}-libs.txt").write_text("\n".join(sorted({m.split()[-1] for m in maps if ".so" in m})))
        options = ["--idle", "--native", "--rate", "50"] if waits else SPY_OPTIONS
        command = ["py-spy", "record", "--format", "raw", "--threads", *options, *(["--gil"] if gil else [])]
        command += ["--duration", str(seconds)]
        command += ["--pid", pid, "--output", str(out / f"{label}-{name}.txt")]
        spies.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        yield
    finally:
        for spy in spies:
            _, err = spy.communicate()
            if spy.returncode:
                print("py-spy:", err.strip()[-300:], flush=True)
