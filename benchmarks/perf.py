"""`make perf`: measure the served model the way users do, and write CSV, a plot and a summary.

1. perf_analyzer (from the tritonclient 2.51.0 wheel, matching the server) on `ensemble` over HTTP
   and on `tensorrt_llm_bls` over gRPC streaming, at each concurrency level, with prompts from
   benchmarks/prompts.json;
2. token-level numbers (time to first token, inter-token latency, output tokens/s) from genai-perf
   0.0.8 on the streaming model (the release nearest the 2.51 server that drives this
   perf_analyzer; checked: it runs with `--service-kind triton --backend tensorrtllm`), and from
   benchmarks.loadgen for both entry points at the same levels;
3. build/perf/: perf_analyzer_<model>.csv, genai_perf.csv, tokens.csv, perf.png (throughput against
   p50/p99 latency, one line per model; output tokens/s against concurrency), summary.md.

Each level sends a fixed number of requests (--requests x concurrency, at least 4, to the load generator;
three times that to perf_analyzer and genai-perf, in one measurement each), so a run's length does not
depend on how steady the host is. The load generator runs first, so neither tool meets a cold server.
A short sweep: `tritonllm perf --levels 1,4 --max-tokens 16` (make perf PERF_ARGS="--levels 1,4 --max-tokens 16").

It uses the server at --http-url/--grpc-url if one answers, else starts one on free ports.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.loadgen import LevelResult, Targets, load_prompts, sweep


class PerfError(RuntimeError):
    pass


def perf_analyzer_env() -> tuple[str, dict[str, str]]:
    """The perf_analyzer binary of this environment and what it needs to load (libb64, libcudart 12)."""
    binary = shutil.which("perf_analyzer", path=str(Path(sys.executable).parent))
    if binary is None:
        raise PerfError("perf_analyzer is missing: it comes with `tritonclient` 2.51.0, run `make build`")
    if subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout.find("libb64.so.0d") < 0:
        raise PerfError("perf_analyzer needs libb64: install Debian's libb64-0d (apt-get install libb64-0d)")
    env = dict(os.environ)
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is None or not spec.submodule_search_locations:
        raise PerfError("perf_analyzer needs libcudart.so.12: pip install nvidia-cuda-runtime-cu12 (make perf does)")
    cudart = Path(next(iter(spec.submodule_search_locations))) / "lib"
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(cudart), env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    return binary, env


def input_data(prompts: list[str], max_tokens: int, stream: bool) -> dict:
    """perf_analyzer --input-data: one entry per prompt, every input the model needs (batch dim left out)."""
    entries = []
    for prompt in prompts:
        entry = {"text_input": [prompt], "max_tokens": [max_tokens], "end_id": [-1], "apply_chat_template": [True]}
        if stream:
            entry["stream"] = [True]
        entries.append(entry)
    return {"data": entries}


def run_perf_analyzer(
    model: str,
    url: str,
    protocol: str,
    data_file: Path,
    levels: list[int],
    request_count,
    out_csv: Path,
    streaming: bool,
) -> list[dict]:
    """perf_analyzer at each level: request_count(concurrency) requests in one measurement."""
    binary, env = perf_analyzer_env()
    rows: list[dict] = []
    for concurrency in levels:
        progress(f"perf_analyzer on {model} ({protocol}), concurrency {concurrency}")
        level_csv = out_csv.with_suffix(f".c{concurrency}.csv")
        command = [
            binary,
            "-m",
            model,
            "-u",
            url,
            "-i",
            protocol,
            "--input-data",
            str(data_file),
            "--shape",
            "text_input:1",
            "--concurrency-range",
            str(concurrency),
            "--request-count",
            str(request_count(concurrency)),
            "-f",
            str(level_csv),
        ]
        if streaming:
            command += ["--streaming", "--async"]
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise PerfError(
                f"perf_analyzer failed on {model} at concurrency {concurrency}:\n{result.stdout[-2000:]}"
                f"{result.stderr[-2000:]}"
            )
        with level_csv.open() as handle:
            rows += list(csv.DictReader(handle))
        level_csv.unlink()
    with out_csv.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


GENAI_METRICS = ("time_to_first_token", "inter_token_latency", "request_latency")


def run_genai_perf(
    grpc_url: str, metrics_url: str, tokenizer_dir: str, levels: list[int], request_count, max_tokens: int, out: Path
) -> list[dict]:
    """genai-perf 0.0.8 on tensorrt_llm_bls (gRPC streaming: with --service-kind triton it speaks gRPC only), one
    run per concurrency level of request_count(concurrency) requests."""
    binary = shutil.which("genai-perf", path=str(Path(sys.executable).parent))
    if binary is None:
        raise PerfError("genai-perf is missing: pip install -r requirements-perf.txt (make perf does)")
    _, env = perf_analyzer_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    rows = []
    for concurrency in levels:
        progress(f"genai-perf on tensorrt_llm_bls (grpc), concurrency {concurrency}")
        artifacts = out / "genai-perf" / f"c{concurrency}"
        command = [
            binary,
            "profile",
            "-m",
            "tensorrt_llm_bls",
            "--service-kind",
            "triton",
            "--backend",
            "tensorrtllm",
            "--streaming",
            "--tokenizer",
            tokenizer_dir,
            "--url",
            grpc_url,
            "--server-metrics-url",
            f"http://{metrics_url}/metrics",
            "--concurrency",
            str(concurrency),
            "--num-prompts",
            "32",
            "--synthetic-input-tokens-mean",
            "40",
            "--synthetic-input-tokens-stddev",
            "0",
            "--output-tokens-mean",
            str(max_tokens),
            "--artifact-dir",
            str(artifacts),
            "--verbose",  # perf_analyzer's own output, which says why it failed, is discarded without it
            "--",  # to perf_analyzer
            "--request-count",
            str(request_count(concurrency)),
        ]
        data = _genai_perf_export(command, env, out, artifacts, concurrency)
        row = {
            "concurrency": concurrency,
            "output_tokens_per_s": round(data["output_token_throughput"]["avg"], 2),
            "requests_per_s": round(data["request_throughput"]["avg"], 3),
        }
        for metric in GENAI_METRICS:
            row[f"{metric}_p50_ms"] = round(data[metric]["p50"], 1)
            row[f"{metric}_p99_ms"] = round(data[metric]["p99"], 1)
        rows.append(row)
    with (out / "genai_perf.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def _genai_perf_export(command: list[str], env: dict, cwd: Path, artifacts: Path, concurrency: int) -> dict:
    """genai-perf's summary of one level. A failed run is shown and tried once more: on a loaded host perf_analyzer
    has ended with an empty profile export that genai-perf then failed to parse, while the server answered."""
    why = ""
    for attempt in range(2):
        if attempt:
            progress(f"{why}\nperf: trying genai-perf once more")
        shutil.rmtree(artifacts, ignore_errors=True)
        result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=cwd)
        exports = list(artifacts.glob("**/profile_export_genai_perf.json"))
        if result.returncode == 0 and exports:
            return json.loads(exports[0].read_text())
        why = f"genai-perf failed at concurrency {concurrency}:\n{result.stdout[-3000:]}{result.stderr[-1500:]}"
    raise PerfError(why)


def progress(text: str) -> None:
    print(f"perf: {text} ...", flush=True)


def write_tokens_csv(results: list[LevelResult], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(results[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)


def plot(pa: dict[str, list[dict]], tokens: list[LevelResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for model, rows in pa.items():
        throughput = [float(r["Inferences/Second"]) for r in rows]
        for key, style in (("p50 latency", "-o"), ("p99 latency", "--x")):
            left.plot(throughput, [float(r[key]) / 1000 for r in rows], style, label=f"{model} {key.split()[0]}")
    left.set_xlabel("throughput (requests/s)")
    left.set_ylabel("latency (ms)")
    left.set_title("perf_analyzer: latency against throughput")
    left.legend(fontsize=8)
    for target in sorted({r.target for r in tokens}):
        rows = [r for r in tokens if r.target == target]
        right.plot([r.concurrency for r in rows], [r.output_tokens_per_s for r in rows], "-o", label=target)
    right.set_xlabel("concurrent requests")
    right.set_ylabel("output tokens/s")
    right.set_title("output tokens/s against concurrency")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(pa: dict[str, list[dict]], tokens: list[LevelResult], genai: list[dict], settings: dict) -> str:
    lines = ["# make perf", "", "Settings: " + ", ".join(f"{k} {v}" for k, v in settings.items()), ""]
    lines += ["## perf_analyzer", "", "| model | concurrency | requests/s | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for model, rows in pa.items():
        for r in rows:
            lines.append(
                f"| {model} | {r['Concurrency']} | {float(r['Inferences/Second']):.2f} | "
                f"{float(r['p50 latency']) / 1000:.0f} | {float(r['p99 latency']) / 1000:.0f} |"
            )
    lines += [
        "",
        "## genai-perf 0.0.8 (tensorrt_llm_bls, gRPC streaming, synthetic prompts of 40 tokens)",
        "",
        "| concurrency | output tokens/s | requests/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | latency p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in genai:
        lines.append(
            f"| {r['concurrency']} | {r['output_tokens_per_s']} | {r['requests_per_s']} | "
            f"{r['time_to_first_token_p50_ms']} | {r['time_to_first_token_p99_ms']} | "
            f"{r['inter_token_latency_p50_ms']} | {r['request_latency_p50_ms']} |"
        )
    lines += [
        "",
        "## Tokens (benchmarks.loadgen)",
        "",
        "| target | concurrency | output tokens/s | requests/s | TTFT p50 ms | ITL mean ms | latency p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in tokens:
        lines.append(
            f"| {r.target} | {r.concurrency} | {r.output_tokens_per_s} | {r.requests_per_s} | "
            f"{r.ttft_p50_ms if r.ttft_p50_ms is not None else '-'} | "
            f"{r.itl_mean_ms if r.itl_mean_ms is not None else '-'} | {r.latency_p50_ms} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from tritonllm.launch.tritonserver import TritonServer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http-url", default="127.0.0.1:8000")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--metrics-url", default="127.0.0.1:8002", help="the server's metrics, for genai-perf")
    parser.add_argument("--build-dir", type=Path, default=Path("build"))
    parser.add_argument("--levels", default="1,2,4,8,16", help="concurrency levels, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates")
    parser.add_argument(
        "--requests",
        type=int,
        default=2,
        help="the load generator's requests per level = this x concurrency (min 4); perf_analyzer and genai-perf "
        "send three times as many",
    )
    args = parser.parse_args(argv)
    try:
        levels = [int(x) for x in args.levels.split(",")]
    except ValueError:
        parser.error(f"--levels takes comma-separated integers, not {args.levels!r}")
    if not levels or min(levels) < 1 or args.max_tokens < 1 or args.requests < 1:
        parser.error("--levels, --max-tokens and --requests must be at least 1")
    per_level = lambda c: max(4, args.requests * c)  # noqa: E731
    started = time.monotonic()
    out = args.build_dir / "perf"
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts()

    build = args.build_dir.resolve()
    host, port = args.http_url.rsplit(":", 1)
    server = TritonServer(build / "model_repository", build / "tritonserver", http_port=int(port), host=host)
    if not server.is_ready():
        print("No server answers at", args.http_url, "- starting one on free ports ...", flush=True)
        server = TritonServer.on_free_ports(build, log_file=out / "server.log")
        server.start()
        args.http_url, args.grpc_url = server.http_url, f"{server.host}:{server.grpc_port}"
        args.metrics_url = f"{server.host}:{server.metrics_port}"
    else:
        server = None
    try:
        progress("load generator on tensorrt_llm_bls (grpc) and ensemble (http); it warms both up first")
        make = lambda: Targets(args.grpc_url, args.http_url, prompts, args.max_tokens)  # noqa: E731
        tokens = asyncio.run(_sweep(make, ["stream", "ensemble"], levels, per_level))
        pa = {}
        for model, url, protocol, stream in (
            ("ensemble", args.http_url, "http", False),
            ("tensorrt_llm_bls", args.grpc_url, "grpc", True),
        ):
            data_file = out / f"input_{model}.json"
            data_file.write_text(json.dumps(input_data(prompts, args.max_tokens, stream), ensure_ascii=False))
            pa[model] = run_perf_analyzer(
                model,
                url,
                protocol,
                data_file,
                levels,
                lambda c: 3 * per_level(c),
                out / f"perf_analyzer_{model}.csv",
                stream,
            )
        manifest = json.loads((build / "manifest.json").read_text())
        genai = run_genai_perf(
            args.grpc_url,
            args.metrics_url,
            manifest["tokenizer_dir"],
            levels,
            lambda c: 3 * per_level(c),
            args.max_tokens,
            out.resolve(),
        )
    except PerfError as exc:
        print(f"perf: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    write_tokens_csv(tokens, out / "tokens.csv")
    plot(pa, tokens, out / "perf.png")
    settings = {"max_tokens": args.max_tokens, "levels": args.levels, "requests": f"{args.requests} x concurrency"}
    text = summary(pa, tokens, genai, settings)
    (out / "summary.md").write_text(text)
    print(text)
    print(f"perf: done in {time.monotonic() - started:.0f} s; CSV, plot and summary in {out}/")
    return 0


async def _sweep(make_targets, names, levels, per_level) -> list[LevelResult]:
    targets = make_targets()  # its aio clients belong to this event loop
    try:
        return await sweep(targets, names, levels, per_level)
    finally:
        await targets.close()


if __name__ == "__main__":
    raise SystemExit(main())
