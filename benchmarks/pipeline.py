"""`make bench-pipeline`: what the Python pipeline around the engine carries, at TensorRT-LLM's rates.

The repository is built with the synthetic benchmark engine (tritonllm/engine/synthetic.py: a fixed passage at
--step-ms per step for up to the top level's sequences at once, a few microseconds of CPU per token), so that what
runs out first is the pipeline: preprocessing, postprocessing, tensorrt_llm (the engine's face), tensorrt_llm_bls, the
OpenAI layer and Triton between them. At each concurrency level every entry point runs closed-loop for --seconds, right
after the engine model alone at the same load (`tensorrt_llm_decoupled` fed the same token ids: streamed for the
streaming entry points, one response per request for `ensemble`), so each figure has its baseline from the same minute:

  engine_stream  the engine, gRPC streaming            engine_whole   the engine, one response per request
  bls_grpc       tensorrt_llm_bls, gRPC streaming      ensemble_http  ensemble, HTTP /infer
  bls_sse        tensorrt_llm_bls, HTTP SSE            ensemble_grpc  ensemble, gRPC
  openai_chat    the OpenAI layer, streamed chat

Reported per (entry point, level): output tokens/s and requests/s in steady state (each client worker sends for
--seconds and at least three requests; its rate counts those between its first and its last, summed over the
workers), the ratio to the engine alone, the time to first token and between tokens *added* to the engine's (p50,
p99; for `ensemble`, the request latency added), and the CPU seconds per 1,000 output tokens of each process:
tritonserver, each model's stub, the OpenAI layer and the load generator (in --clients processes). Written under
--out: pipeline.csv, pipeline.png (when matplotlib imports), summary.md.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import csv
import json
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.loadgen import Record, Targets, chat_token_ids, token_latencies
from benchmarks.procs import alive, children, cpu_seconds, profiled, stub_pids

PAIRS = {  # entry point -> the engine-alone target it is compared with (the engine alone: itself)
    "engine_stream": "engine_stream",
    "engine_whole": "engine_whole",
    "bls_grpc": "engine_stream",
    "bls_sse": "engine_stream",
    "openai_chat": "engine_stream",
    "ensemble_http": "engine_whole",
    "ensemble_grpc": "engine_whole",
}
METHODS = {  # target -> loadgen.Targets method
    "engine_stream": "engine_stream",
    "engine_whole": "engine_whole",
    "bls_grpc": "stream",
    "bls_sse": "sse",
    "openai_chat": "openai_chat",
    "ensemble_http": "ensemble",
    "ensemble_grpc": "ensemble_grpc",
}
MIN_ROUNDS = 3  # requests per worker and level, at least: the first round starts in step and is not steady
STALLED = "no answer: the server stalled"
GRACE_S = 120.0  # how long past a level's end a request may take before it counts as stalled
WORDS = [
    "signal",
    "harbour",
    "lantern",
    "copper",
    "meadow",
    "orbit",
    "quiet",
    "ember",
    "velvet",
    "summit",
    "river",
    "crystal",
    "thunder",
    "garden",
    "pilot",
    "marble",
    "echo",
    "falcon",
    "prairie",
    "canyon",
    "violet",
    "anchor",
    "glacier",
    "compass",
    "willow",
    "ember",
    "saffron",
    "beacon",
]


@dataclass
class Level:
    target: str
    concurrency: int
    requests: int
    errors: int
    window_s: float
    output_tokens_per_s: float
    requests_per_s: float
    responses_per_s: float | None  # the engine model's own targets: responses that carried tokens
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    latency_p50_ms: float
    latency_p99_ms: float
    cpu_s_per_1k_tokens: dict[str, float]
    cores: dict[str, float]  # CPU seconds per second of the level, per process group
    first_error: str | None = None


def prompts(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` different prompts of about `tokens` tokens each (words in a different order for each)."""
    out = []
    for i in range(count):
        words = [WORDS[(i * 7 + k * (i % 5 + 1)) % len(WORDS)] for k in range(tokens * 2)]
        text = " ".join(words)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
        out.append(tokenizer.decode(ids))
    return out


# ---------------------------------------------------------------------------------------------- the load generator


def _client(job: dict) -> tuple[list[list[Record]], float]:
    """In a client process: `job["concurrency"]` closed-loop workers, each sending until `job["stop_at"]` (time.time
    clock) and at least MIN_ROUNDS requests. Returns each worker's records (times on the time.time clock) and the
    process's CPU seconds."""
    started_cpu = time.process_time()
    records = asyncio.run(_closed_loop(job))
    return records, time.process_time() - started_cpu


async def _closed_loop(job: dict) -> list[list[Record]]:
    targets = Targets(
        job["grpc_url"],
        job["http_url"],
        job["prompts"],
        job["max_tokens"],
        token_ids=job["token_ids"],
        connections=max(8, job["concurrency"]),
        openai=job["openai"],
    )
    send = getattr(targets, METHODS[job["target"]])
    offset = time.time() - time.perf_counter()
    records: list[list[Record]] = [[] for _ in range(job["concurrency"])]

    async def worker(k: int) -> None:
        i = job["first"] + k * job["stride"]
        mine = records[k]
        while time.time() < job["stop_at"] or len(mine) < MIN_ROUNDS:
            started = time.perf_counter()
            deadline = max(job["stop_at"] - time.time(), 0.0) + job["grace_s"]
            try:  # a request that outlives the level's deadline by far means a stalled server: an error, not a hang
                record = await asyncio.wait_for(send(i), deadline)
            except (TimeoutError, asyncio.TimeoutError):
                record = Record(started, time.perf_counter(), None, 0, STALLED)
            first = None if record.first_token is None else record.first_token + offset
            mine.append(replace(record, start=record.start + offset, end=record.end + offset, first_token=first))
            if record.error == STALLED:
                return
            i += job["stride"] * job["concurrency"]

    try:
        await asyncio.gather(*(worker(k) for k in range(job["concurrency"])))
    finally:
        await targets.close()
    return records


# ---------------------------------------------------------------------------------------------- CPU accounting


def process_groups(server_pid: int, openai_pid: int | None) -> dict[str, list[int]]:
    """tritonserver, each model's stub processes (by model name), the OpenAI layer's supervisor and each process it
    started apart (`openai-1`, ...; its workers): whether the port's connections spread over them shows in
    their cores."""
    groups: dict[str, list[int]] = {"tritonserver": [server_pid]}
    for model, pid in stub_pids():
        groups.setdefault(model, []).append(int(pid))
    if openai_pid is not None:
        groups["openai-supervisor"] = [openai_pid]
        for number, pid in enumerate(children(openai_pid), 1):
            groups[f"openai-{number}"] = [pid]
    return groups


def cpu_snapshot(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in groups.items()}


# ---------------------------------------------------------------------------------------------- one level


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def steady_rates(workers: list[list[Record]]) -> tuple[float, float, float, float]:
    """(output tokens/s, requests/s, responses/s, mean seconds measured per worker): each worker's own rate over
    its requests after the first and before the last (back to back, so their span is the time between those two),
    summed over the workers. The first requests of a level start together and the last ones end while others have
    stopped: neither is steady; every worker sends at least MIN_ROUNDS requests so that one is left between them."""
    tokens = requests = responses = spans = 0.0
    measured = 0
    for worker in workers:
        middle = worker[1:-1]
        span = worker[-1].start - worker[0].end if len(worker) >= 3 else 0.0
        if span <= 0:
            continue
        good = [r for r in middle if r.error is None]
        tokens += sum(r.output_tokens for r in good) / span
        requests += len(good) / span
        responses += sum(r.responses for r in good) / span
        spans += span
        measured += 1
    return tokens, requests, responses, spans / measured if measured else 0.0


def summarize(target: str, concurrency: int, workers: list[list[Record]], cpu: dict, elapsed: float) -> Level:
    records = [r for w in workers for r in w]
    good = [r for r in records if r.error is None]
    if not good:
        raise RuntimeError(f"{target} at concurrency {concurrency}: every request failed: {records[0].error}")
    tokens_per_s, requests_per_s, responses_per_s, window = steady_rates(workers)
    tokens = sum(r.output_tokens for r in good)
    ttft, itl, latency = token_latencies(good)
    errors = [r for r in records if r.error is not None]
    return Level(
        target=target,
        concurrency=concurrency,
        requests=len(good),
        errors=len(errors),
        window_s=round(window, 3),
        output_tokens_per_s=round(tokens_per_s, 1),
        requests_per_s=round(requests_per_s, 2),
        responses_per_s=round(responses_per_s, 1) if responses_per_s else None,
        ttft_p50_ms=_pct(ttft, 50),
        ttft_p99_ms=_pct(ttft, 99),
        itl_p50_ms=_pct(itl, 50),
        itl_p99_ms=_pct(itl, 99),
        latency_p50_ms=_pct(latency, 50),
        latency_p99_ms=_pct(latency, 99),
        cpu_s_per_1k_tokens={k: round(v * 1000 / max(tokens, 1), 4) for k, v in cpu.items()},
        cores={k: round(v / elapsed, 2) for k, v in cpu.items()},
        first_error=errors[0].error[:300] if errors else None,
    )


class Bench:
    def __init__(self, args, server, openai, token_ids: list[list[int]], texts: list[str]) -> None:
        self.args, self.server, self.openai = args, server, openai
        self.base = {
            "grpc_url": f"{server.host}:{server.grpc_port}",
            "http_url": server.http_url,
            "prompts": texts,
            "token_ids": token_ids,
            "max_tokens": args.max_tokens,
            "openai": (openai.url, openai.served_name) if openai else None,
        }
        context = multiprocessing.get_context("spawn")
        self.pool = concurrent.futures.ProcessPoolExecutor(args.clients, mp_context=context)
        list(self.pool.map(time.sleep, [0.0] * args.clients))  # start them before anything is measured

    def run(
        self,
        target: str,
        concurrency: int,
        seconds: float,
        profile_dir: Path | None = None,
        gil: bool = False,
        waits: bool = False,
    ) -> Level:
        """One level; with `profile_dir`, py-spy records every process of the server but tritonserver (C++) for
        the level's `seconds`."""
        groups = process_groups(self.server.process.pid, self.openai.process.pid if self.openai else None)
        spied = [(f"{name}-{pid}", str(pid)) for name, pids in groups.items() if name != "tritonserver" for pid in pids]
        with profiled(profile_dir, f"{target}-c{concurrency}", max(1, int(seconds)), spied, gil, waits):
            return self._run(target, concurrency, seconds, groups)

    def _run(self, target: str, concurrency: int, seconds: float, groups: dict[str, list[int]]) -> Level:
        clients = min(self.args.clients, concurrency)
        shares = [concurrency // clients + (k < concurrency % clients) for k in range(clients)]
        before, started = cpu_snapshot(groups), time.perf_counter()
        stop_at = time.time() + seconds
        jobs = [
            {
                **self.base,
                **{"target": target, "concurrency": n, "first": k, "stride": clients, "stop_at": stop_at},
                "grace_s": GRACE_S,
            }
            for k, n in enumerate(shares)
        ]
        workers, client_cpu = [], 0.0
        for got, used in self.pool.map(_client, jobs):
            workers += got
            client_cpu += used
        elapsed = time.perf_counter() - started
        if dead := [f"{name} (pid {pid})" for name, pids in groups.items() for pid in pids if not alive(pid)]:
            raise RuntimeError(f"{target} at concurrency {concurrency}: process ended: {', '.join(dead)}")
        after = cpu_snapshot(groups)
        cpu = {name: after[name] - before[name] for name in groups}
        cpu["client"] = client_cpu
        return summarize(target, concurrency, workers, cpu, elapsed)

    def close(self) -> None:
        self.pool.shutdown()


# ---------------------------------------------------------------------------------------------- reports


def added(level: Level, base: Level, name: str) -> float | None:
    mine, theirs = getattr(level, name), getattr(base, name)
    return None if mine is None or theirs is None else round(mine - theirs, 2)


def table_rows(levels: dict[tuple[str, int], Level]) -> list[dict]:
    rows = []
    for (target, concurrency), level in levels.items():
        base = levels.get((PAIRS.get(target, target), concurrency))
        row = {k: v for k, v in asdict(level).items() if k not in ("cpu_s_per_1k_tokens", "cores")}
        row["baseline"] = base.target if base else ""
        row["ratio_to_engine"] = (
            round(level.output_tokens_per_s / base.output_tokens_per_s, 3)
            if base and base is not level and base.output_tokens_per_s
            else None
        )
        for name in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "latency_p50_ms", "latency_p99_ms"):
            row[f"added_{name}"] = added(level, base, name) if base and base is not level else None
        row["cpu_s_per_1k_tokens"] = round(sum(level.cpu_s_per_1k_tokens.values()), 4)
        for name, value in sorted(level.cpu_s_per_1k_tokens.items()):
            row[f"cpu_{name}"] = value
        for name, value in sorted(level.cores.items()):
            row[f"cores_{name}"] = value
        rows.append(row)
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (tokens, gaps) = plt.subplots(1, 2, figsize=(13, 5))
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = sorted((r for r in rows if r["target"] == target), key=lambda r: r["concurrency"])
        levels = [r["concurrency"] for r in mine]
        style = "--" if target.startswith("engine") else "-"
        tokens.plot(levels, [r["output_tokens_per_s"] for r in mine], style, marker="o", label=target)
        if target in PAIRS and PAIRS[target] == "engine_stream" and target != "engine_stream":
            gaps.plot(levels, [r["added_itl_p50_ms"] for r in mine], marker="o", label=f"{target} p50")
            gaps.plot(levels, [r["added_itl_p99_ms"] for r in mine], ":", marker=".", label=f"{target} p99")
    for axis, title in ((tokens, "output tokens/s"), (gaps, "time between tokens added to the engine's, ms")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent requests")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def summary(rows: list[dict], settings: dict) -> str:
    def cell(value) -> str:
        return "" if value is None else f"{value:+.2f}" if isinstance(value, float) and value < 0 else str(value)

    lines = [
        "# bench-pipeline",
        "",
        "Settings: " + ", ".join(f"{k} {v}" for k, v in settings.items()),
        "",
        "| target | conc. | tok/s | req/s | resp/s | / engine | +TTFT p50 | +TTFT p99 | +TBT p50 | +TBT p99 "
        "| +latency p50 | errors | CPU s / 1k tok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["target"])):
        lines.append(
            "| "
            + " | ".join(
                cell(r[k])
                for k in (
                    "target",
                    "concurrency",
                    "output_tokens_per_s",
                    "requests_per_s",
                    "responses_per_s",
                    "ratio_to_engine",
                    "added_ttft_p50_ms",
                    "added_ttft_p99_ms",
                    "added_itl_p50_ms",
                    "added_itl_p99_ms",
                    "added_latency_p50_ms",
                    "errors",
                    "cpu_s_per_1k_tokens",
                )
            )
            + " |"
        )
    components = sorted({k[4:] for r in rows for k in r if k.startswith("cpu_") and k != "cpu_s_per_1k_tokens"})
    lines += [
        "",
        "Where the CPU goes: seconds per 1,000 output tokens, per process group.",
        "",
        "| target | conc. | " + " | ".join(components) + " |",
        "|---|---|" + "---|" * len(components),
    ]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["target"])):
        values = " | ".join(cell(r.get(f"cpu_{c}")) for c in components)
        lines.append(f"| {r['target']} | {r['concurrency']} | {values} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- main


def tokenizer_folder(tokenizer_dir: Path, out: Path) -> Path:
    """A folder the build takes for a model (config.json + tokenizer) from tokenizer files alone: the synthetic
    engine needs only the tokenizer and the vocabulary (a GPU host given the bundle's tokenizer, gpu_bench.sh)."""
    from transformers import AutoTokenizer, LlamaConfig

    shutil.copytree(tokenizer_dir, out, dirs_exist_ok=True)
    LlamaConfig(vocab_size=len(AutoTokenizer.from_pretrained(out))).save_pretrained(out)
    return out


def build_repository(args) -> Path:
    """The synthetic engine's repository, with the main build's tokenizer (or --model)."""
    from tritonllm.repository.builder import main as build_main

    model = args.model
    if args.tokenizer_dir is not None:
        model = tokenizer_folder(args.tokenizer_dir, args.out / "tokenizer-model")
    elif model is None:
        manifest = args.build_dir / "manifest.json"
        if not manifest.is_file():
            raise SystemExit(f"bench-pipeline: no {manifest}: run `make build` first (its tokenizer is used)")
        model = json.loads(manifest.read_text())["model_dir"]
    build = args.out / "engine"
    top = max(args.levels)
    code = build_main(
        [
            "--engine",
            "synthetic",
            "--model",
            str(model),
            "--build-dir",
            str(build),
            "--step-ms",
            str(args.step_ms),
            "--max-batch-size",
            str(top),
            "--max-queue-size",
            str(top),
            "--max-seq-len",
            str(max(1024, 2 * (args.prompt_tokens + args.max_tokens))),
            *args.build_args,
        ]
    )
    if code:
        raise SystemExit(f"bench-pipeline: the synthetic engine's build failed ({code})")
    return build


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from tritonllm.launch.tritonserver import OpenAIFrontend, TritonServer, free_port

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", type=Path, default=Path("build"), help="the main build (for its tokenizer)")
    parser.add_argument("--model", help="a Hugging Face folder whose tokenizer to use (default: the main build's)")
    parser.add_argument("--tokenizer-dir", type=Path, help="tokenizer files alone, instead of --model")
    parser.add_argument("--out", type=Path, default=None, help="default: BUILD_DIR/bench-pipeline")
    parser.add_argument("--levels", default="1,4,16,64,256,512,1024", help="concurrency levels, comma-separated")
    parser.add_argument("--targets", default=",".join(PAIRS), help=f"entry points among {', '.join(PAIRS)}")
    parser.add_argument("--seconds", type=float, default=8.0, help="closed-loop time per target and level")
    parser.add_argument("--step-ms", type=float, default=6.0, help="the synthetic engine's time per step")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 4)))
    parser.add_argument("--openai-workers", type=int, help="the OpenAI layer's processes (default: its own)")
    parser.add_argument(
        "--profile-dir", type=Path, help="py-spy profiles of each stub and the OpenAI layer, per level (needs py-spy)"
    )
    parser.add_argument(
        "--profile-gil", action="store_true", help="with --profile-dir: only samples that hold the GIL (py-spy --gil)"
    )
    parser.add_argument(
        "--profile-waits",
        action="store_true",
        help="with --profile-dir: waiting threads too, with native frames (py-spy --idle --native, 50 Hz, pausing)",
    )
    parser.add_argument("--build-args", nargs=argparse.REMAINDER, default=[], help="more build_engines.py options")
    args = parser.parse_args(argv)
    args.build_dir = args.build_dir.resolve()
    args.out = (args.out or args.build_dir / "bench-pipeline").resolve()
    args.levels = [int(v) for v in args.levels.split(",")]
    targets = [t for t in args.targets.split(",") if t]
    if unknown := [t for t in targets if t not in PAIRS]:
        raise SystemExit(f"bench-pipeline: unknown targets {unknown}; choose among {', '.join(PAIRS)}")
    if args.profile_gil and args.profile_waits:
        raise SystemExit(
            "bench-pipeline: --profile-gil keeps the samples holding the GIL, --profile-waits the waiting "
            "ones too: choose one"
        )
    if args.profile_dir and shutil.which("py-spy") is None:
        raise SystemExit("bench-pipeline: --profile-dir needs py-spy on PATH (pip install py-spy)")
    args.out.mkdir(parents=True, exist_ok=True)
    build = build_repository(args)
    manifest = json.loads((build / "manifest.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(manifest["tokenizer_dir"])
    texts = prompts(tokenizer, 64, args.prompt_tokens)
    token_ids = chat_token_ids(tokenizer, texts)

    server = TritonServer.on_free_ports(build, log_file=args.out / "server.log")
    openai = None
    if "openai_chat" in targets:
        openai = OpenAIFrontend.for_build(
            f"{server.host}:{server.grpc_port}",
            manifest,
            free_port(),
            log_file=args.out / "openai.log",
            workers=args.openai_workers,
            repository=str(server.repository),
        )
    started = time.perf_counter()
    server.start(timeout=600)
    if openai:
        openai.start()
    print(f"bench-pipeline: server ready in {time.perf_counter() - started:.1f} s", flush=True)
    bench = Bench(args, server, openai, token_ids, texts)
    levels: dict[tuple[str, int], Level] = {}
    failure = None
    try:
        for target in dict.fromkeys(t for name in targets for t in (PAIRS[name], name)):  # warm-up
            bench.run(target, 2, 1.0)
        for concurrency in args.levels:
            for name in targets:
                for target in (PAIRS[name], name):
                    if (target, concurrency) in levels and target.startswith("engine"):
                        continue  # one engine baseline per kind and level, run just before its first entry point
                    level = bench.run(
                        target, concurrency, args.seconds, args.profile_dir, args.profile_gil, args.profile_waits
                    )
                    levels[target, concurrency] = level
                    print(json.dumps(asdict(level)), flush=True)
    except RuntimeError as exc:  # what was measured until then is still written
        failure = exc
    finally:
        bench.close()
        if openai:
            openai.stop()
        server.stop()
    rows = table_rows(levels)
    settings = {
        "step_ms": args.step_ms,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "seconds_per_level": args.seconds,
        "client_processes": args.clients,
        "cpus": os.cpu_count(),
    }
    write_csv(rows, args.out / "pipeline.csv")
    plotted = plot(rows, args.out / "pipeline.png")
    text = summary(rows, settings)
    (args.out / "summary.md").write_text(text)
    print("\n" + text)
    print(f"bench-pipeline: wrote {args.out}/pipeline.csv, summary.md" + (", pipeline.png" if plotted else ""))
    if failure is not None:
        print(f"bench-pipeline: stopped early: {failure} (server log: {args.out / 'server.log'})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
