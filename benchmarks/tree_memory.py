"""A server's memory as its whole process tree holds it (tritonserver, its Python-backend stubs, the OpenAI layer).

Two measures. The sum of each process's peak resident memory (VmHWM) counts every page a process ever touched, the
shared ones (libraries, a file mapped by several processes) once per process, and adds peaks that came at different
times: an upper bound. The peak of the tree's proportional set size (Pss: a shared page split among the processes
that map it), sampled while the load runs, is what the machine gave the server at its fullest. For one process
(llama-server) the two agree.
"""

from __future__ import annotations

import threading
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def _tree(roots: list[int]) -> set[int]:
    return {p for root in roots for p in process_tree(root)}


def _field_kib(path: Path, name: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(name):
            return int(line.split()[1])
    return 0


def peak_rss_mib(roots: list[int]) -> float:
    """The sum of each process's peak resident memory (VmHWM), in MiB."""
    total = 0
    for pid in _tree(roots):
        try:
            total += _field_kib(Path(f"/proc/{pid}/status"), "VmHWM:")
        except OSError:
            continue
    return round(total / 1024, 1)


def pss_mib(roots: list[int]) -> float:
    """The tree's proportional set size now, in MiB."""
    total = 0
    for pid in _tree(roots):
        try:
            total += _field_kib(Path(f"/proc/{pid}/smaps_rollup"), "Pss:")
        except OSError:  # gone, or not ours to read
            continue
    return round(total / 1024, 1)


class PeakPss:
    """The tree's largest Pss, sampled every `interval` seconds on a thread of its own from start() to stop()."""

    def __init__(self, roots: list[int], interval: float = 0.5) -> None:
        self.roots, self.interval, self.peak = roots, interval, 0.0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-pss", daemon=True)

    def start(self) -> PeakPss:
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stopped.set()
        self._thread.join()
        return self.peak

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, pss_mib(self.roots))
            if self._stopped.wait(self.interval):
                return
