"""bench-pipeline's arithmetic: the steady window, the added latencies and the ratio to the engine alone; pipeline_ab's
runs and report."""

import json
import os
from pathlib import Path

import pytest

from benchmarks import pipeline_ab
from benchmarks.loadgen import Record
from benchmarks.pipeline import summarize, table_rows
from benchmarks.pipeline_ab import report


def level(target: str, first_token: float, tokens_per_request: int = 10):
    # Two workers, each sending 1 s requests back to back from t=0 to t=10 (the second starting 0.5 s late);
    # one failed request of 0.5 s before the second's.
    workers = [[Record(k, k + 1.0, k + first_token, tokens_per_request) for k in range(10)]]
    workers.append([Record(0.0, 0.5, None, 0, "refused")])
    workers[1] += [Record(k + 0.5, k + 1.5, k + 0.5 + first_token, tokens_per_request) for k in range(9)]
    return summarize(target, 2, workers, {"tensorrt_llm": 2.0, "client": 1.0}, 10.0)


def test_rates_are_each_workers_steady_rate_summed():
    engine = level("engine_stream", 0.01)
    # Each worker's requests between its first and its last: 8 of 10 tokens in 8 s, 10 tokens/s each.
    assert engine.output_tokens_per_s == pytest.approx(20.0)
    assert engine.requests_per_s == pytest.approx(2.0)
    assert engine.window_s == pytest.approx(8.0)
    assert engine.errors == 1 and engine.first_error == "refused"
    assert engine.cpu_s_per_1k_tokens == {"tensorrt_llm": round(2000 / 190, 4), "client": round(1000 / 190, 4)}
    assert engine.cores == {"tensorrt_llm": 0.2, "client": 0.1}


def test_entry_points_are_compared_with_their_engine_baseline():
    engine, bls = level("engine_stream", 0.010), level("bls_grpc", 0.013)
    rows = {r["target"]: r for r in table_rows({("engine_stream", 2): engine, ("bls_grpc", 2): bls})}
    assert rows["bls_grpc"]["baseline"] == "engine_stream"
    assert rows["bls_grpc"]["ratio_to_engine"] == 1.0
    assert rows["bls_grpc"]["added_ttft_p50_ms"] == pytest.approx(3.0)
    assert rows["engine_stream"]["ratio_to_engine"] is None


def test_a_level_where_every_request_failed_says_so():
    with pytest.raises(RuntimeError, match="every request failed: no answer"):
        summarize("ensemble_http", 1, [[Record(0.0, 1.0, None, 0, "no answer")]], {}, 1.0)


def test_the_ab_report_pairs_rounds_and_calls_a_verdict():
    bls, engine = ("bls_grpc", 512), ("engine_stream", 512)
    this = [{bls: 110.0, engine: 90.0}, {bls: 120.0, engine: 100.0}]
    base = [{bls: 100.0, engine: 100.0}, {bls: 100.0, engine: 95.0}]
    base[1].pop(bls)  # a level one run did not reach
    rows = report(this, base).splitlines()[2:]
    assert rows[0] == "| bls_grpc | 512 | 115 (110.0 to 120.0) | 100 (100.0) | 1.100 | 1.100 to 1.100 | ahead |"
    assert rows[1].endswith("| 0.976 | 0.900 to 1.053 | within noise |")


# A checkout's pipeline.py: it records where it ran and with what, in turn, and reports RATE tokens/s.
STUB_PIPELINE = """import json, os, sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True)
with (out.parent / "runs.jsonl").open("a") as runs:
    runs.write(json.dumps({"cwd": os.getcwd(), "argv": sys.argv[1:], "path": os.environ["PYTHONPATH"]}) + "\\n")
(out / "pipeline.csv").write_text("target,concurrency,output_tokens_per_s\\nengine_stream,512,RATE\\n")
"""


def test_each_run_starts_from_its_checkout_in_alternated_order(tmp_path, monkeypatch):
    checkouts = {}
    for side, rate in (("this", 110), ("base", 100)):
        checkouts[side] = tmp_path / side
        (checkouts[side] / "benchmarks").mkdir(parents=True)
        (checkouts[side] / "benchmarks" / "pipeline.py").write_text(STUB_PIPELINE.replace("RATE", str(rate)))
    monkeypatch.setattr(pipeline_ab, "HERE", checkouts["this"])
    out = tmp_path / "out"
    argv = ["--base", str(checkouts["base"]), "--rounds", "3", "--out", str(out), "--tokenizer-dir", "tok"]
    assert pipeline_ab.main([*argv, "--levels", "512", "--build-args", "--engine-process"]) == 0
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    order = [Path(run["cwd"]).name for run in runs]
    assert order == ["this", "base", "base", "this", "this", "base"]
    for run in runs:  # its own code first; the script's options before --build-args, which takes the rest
        assert run["path"].split(os.pathsep)[0] == run["cwd"]
        assert run["argv"][-3:] == ["512", "--build-args", "--engine-process"]
        assert "--build-dir" in run["argv"] and str(Path("tok").resolve()) in run["argv"]
    assert (
        "| engine_stream | 512 | 110 (110.0) | 100 (100.0) | 1.100 | 1.100 to 1.100 | ahead |"
        in (out / "ab.md").read_text()
    )


def test_two_builds_of_this_checkout(tmp_path, monkeypatch):
    this = tmp_path / "this"
    (this / "benchmarks").mkdir(parents=True)
    (this / "benchmarks" / "pipeline.py").write_text(STUB_PIPELINE.replace("RATE", "100"))
    monkeypatch.setattr(pipeline_ab, "HERE", this)
    out = tmp_path / "out"
    argv = ["--rounds", "2", "--out", str(out), "--base-build-args=--engine-process --engine-instances 1"]
    assert (
        pipeline_ab.main([*argv, "--levels", "512", "--build-args", "--engine-process", "--engine-instances", "4"]) == 0
    )
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert {Path(run["cwd"]).name for run in runs} == {"this"}
    builds = [run["argv"][run["argv"].index("--build-args") + 1 :] for run in runs]
    assert builds == [["--engine-process", "--engine-instances", n] for n in ("4", "1", "1", "4")]
    assert all(run["argv"][run["argv"].index("--levels") + 1] == "512" for run in runs)


@pytest.mark.parametrize(
    "argv",
    [
        ["--levels", "512"],
        ["--base-build-args=--engine-process", "--build-args", "--engine-process"],
        ["--base-build-args="],
    ],
)
def test_a_comparison_of_one_build_with_itself_is_refused(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.setattr(pipeline_ab, "HERE", tmp_path)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "pipeline.py").write_text("")
    with pytest.raises(SystemExit) as exit_:
        pipeline_ab.main(["--out", str(tmp_path / "out"), *argv])
    assert exit_.value.code == 2 and "same build" in capsys.readouterr().err
