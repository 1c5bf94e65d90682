"""Unit: make perf's genai-perf step shows a failed run and tries it once more."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import perf


def fake_runs(monkeypatch, artifacts, outcomes):
    """subprocess.run answering each call with the next outcome: a summary it writes, or None for a failure."""
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        summary = outcomes[len(calls) - 1]
        if summary is None:
            return subprocess.CompletedProcess(command, 1, "perf_analyzer: Thread [0] had error", "Traceback")
        (artifacts / "x").mkdir(parents=True)
        (artifacts / "x" / "profile_export_genai_perf.json").write_text(json.dumps(summary))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(perf.subprocess, "run", run)
    return calls


def test_a_failed_genai_perf_run_is_shown_and_tried_once_more(monkeypatch, tmp_path, capsys):
    artifacts = tmp_path / "c1"
    calls = fake_runs(monkeypatch, artifacts, [None, {"request_throughput": {"avg": 2.0}}])
    assert perf._genai_perf_export(["genai-perf"], {}, tmp_path, artifacts, 1) == {"request_throughput": {"avg": 2.0}}
    assert len(calls) == 2
    assert "Thread [0] had error" in capsys.readouterr().out


def test_two_failed_genai_perf_runs_stop_the_measurement_with_its_output(monkeypatch, tmp_path):
    artifacts = tmp_path / "c1"
    fake_runs(monkeypatch, artifacts, [None, None])
    with pytest.raises(perf.PerfError, match="concurrency 4:\nperf_analyzer: Thread"):
        perf._genai_perf_export(["genai-perf"], {}, tmp_path, artifacts, 4)
