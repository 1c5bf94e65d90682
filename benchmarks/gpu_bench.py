"""The GPU comparison (NVIDIA H200): the portable engine served by Triton against transformers in-process.

Runs on an NVIDIA GPU host with no network and no real weights: builds a model of the Qwen2.5-7B shape
with random bf16 weights (SmolLM2's tokenizer, whose ids fit the vocabulary), measures transformers'
continuous batching in-process, then serves the same folder with `build_engines.py` +
tritonserver and measures output tokens/s through `tensorrt_llm_bls` (gRPC streaming), with the same
workload: N requests of PROMPT_TOKENS prompt + OUTPUT_TOKENS generated tokens. Prints JSON lines;
benchmarks/gpu_bench.sh sets up the environment; docs/performance.md has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import re
import sys
import threading
import time
import uuid
from pathlib import Path
from unittest import mock

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.procs import SPY_OPTIONS, profiled, stub_pids  # noqa: E402  (run as a script: needs ROOT)
from benchmarks.procs import cpu_seconds as process_cpu_seconds  # noqa: E402

QWEN_7B = dict(  # Qwen2.5-7B's shape (config.json of the released model)
    architectures=["Qwen2ForCausalLM"],
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    model_type="qwen2",
)


EQUIVALENCE_REQUESTS, EQUIVALENCE_TOKENS = 32, 48


def make_model(out: Path, tokenizer_dir: Path, dtype: str):
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in QWEN_7B.items() if k != "architectures"})
    config.architectures = QWEN_7B["architectures"]
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.glob("*"):
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return model


def prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    base = tokenizer("The quick brown fox jumps over the lazy dog and keeps running far away. ")["input_ids"]
    return [((base * (tokens // len(base) + 2))[i % 7 : i % 7 + tokens]) for i in range(n)]


def run_engine(engine, batches: list[list[list[int]]], output_tokens: int, streaming=False, spread_s=0.0) -> dict:
    """Each batch of prompts submitted at once (or evenly over `spread_s` seconds, as a server receives them),
    one batch after the other: output tokens/s, TTFT p50, the decode rate after the first token (1 / the
    median time per output token: what a stream sees once it started) and the CUDA graphs before and after."""
    from tritonllm.engine.api import GenerationRequest

    finals, tokens, graphs = [], 0, engine.captured_graphs()

    def record(_: int, emission) -> None:
        nonlocal tokens
        tokens += len(emission.token_ids)
        if emission.final:
            finals.append(emission)

    started = time.perf_counter()
    for batch in batches:
        complete(
            engine, [GenerationRequest(ids, output_tokens, streaming=streaming) for ids in batch], record, spread_s
        )
    elapsed = time.perf_counter() - started
    assert all(f.error is None for f in finals), [f.error for f in finals if f.error]
    per_token = [f.time_per_output_token for f in finals if f.time_per_output_token]
    firsts = [f.time_to_first_token for f in finals]
    return {
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "ttft_p50_ms": round(float(np.percentile(firsts, 50)) * 1000, 1),
        "decode_tokens_per_s": round(1 / float(np.percentile(per_token, 50)), 1) if per_token else None,
        # a few requests: each one's wait, to see which met a new step shape
        **({"ttfts_ms": [round(t * 1000, 1) for t in firsts]} if len(firsts) <= 8 else {}),
        "graphs": f"{graphs} -> {engine.captured_graphs()}",
    }


@contextlib.contextmanager
def timeline(sample, into: dict, every: float = 0.5):
    """into["batch_timeline"]: [seconds, requests in the batch, requests waiting] every `every` s while the block runs
    (how fast the batch fills and drains: served requests reach the engine over time, in-process ones at once)."""
    points: list[list] = []
    done = threading.Event()

    def loop() -> None:
        started = time.perf_counter()
        while not done.wait(every):
            points.append([round(time.perf_counter() - started, 1), *sample()])

    sampler = threading.Thread(target=loop, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        into["batch_timeline"] = points


def engine_load(engine) -> tuple[int, int]:
    """An in-process engine's requests in the batch and waiting."""
    in_batch = engine.in_batch()
    return in_batch, engine.running() - in_batch


def engine_gauges(server) -> tuple[int, int]:
    """The engine's running and waiting request gauges, read from the server's metrics."""
    from tritonllm.launch.tritonserver import metric_samples, metric_value

    samples = metric_samples(server.metrics(timeout=5))
    running, waiting = (
        int(metric_value(samples, "tritonllm_engine_requests", state=s)) for s in ("running", "waiting")
    )
    return running, waiting


def served_graphs(server) -> int:
    """The served engine's CUDA graphs: its gauge, which the engine model updates every 0.2 s."""
    from tritonllm.launch.tritonserver import metric_samples, metric_value

    time.sleep(0.5)
    return int(metric_value(metric_samples(server.metrics(timeout=5)), "tritonllm_cuda_graphs"))


def in_process(
    model_dir: Path, ids: list[list[int]], output_tokens: int, options: dict, seq_len: int, profile: Path | None
) -> dict:
    """The portable engine in this process with EngineConfig `options`: 3 single streams, then all requests."""
    started = time.perf_counter()
    with cuda_engine(model_dir, len(ids), seq_len, options) as engine:
        result = {"start_s": round(time.perf_counter() - started, 1)}
        run_engine(engine, [ids[:8]], 8)  # warm-up
        result["c1"] = run_engine(engine, [[i] for i in ids[:3]], output_tokens)
        if profile is not None:
            result["c1_device_per_token"] = kernel_profile(engine, ids[0], profile / "c1-kernels.txt")
        result[f"c{len(ids)}_first"] = run_engine(engine, [ids], output_tokens)  # meets new shapes
        # The third arrives over 2 s like the served requests do: its steps meet batch shapes the warm-up did
        # not (the cuDNN attention builds a graph per new shape).
        runs = [("", False, 0.0), ("_streaming", True, 0.0), ("_streaming_spread", True, 2.0)]
        for suffix, streaming, spread_s in runs:
            label, gauges = f"c{len(ids)}{suffix}", {}
            spied = profile if not suffix else None
            with (
                profiled(spied, label, seconds=10, pids=[("in_process", str(os.getpid()))]),
                timeline(functools.partial(engine_load, engine), gauges),
            ):
                result[label] = run_engine(engine, [ids], output_tokens, streaming, spread_s)
            result[label].update(gauges)
    return result


@contextlib.contextmanager
def cuda_engine(model_dir: Path, batch: int, seq_len: int, options: dict):
    """A PortableEngine on the GPU for `batch` requests of up to `seq_len` tokens, shut down after the block.
    The memory of engines shut down before (cycles through their threads keep them alive) is returned first."""
    import gc

    from tritonllm.engine.api import EngineConfig
    from tritonllm.engine.portable import PortableEngine

    gc.collect()
    torch.cuda.empty_cache()
    config = EngineConfig(
        model_dir=str(model_dir),
        device="cuda",
        max_batch_size=batch,
        max_seq_len=seq_len,
        kv_cache_tokens=batch * seq_len,
        max_batch_tokens=4096,
        **options,
    )
    engine = PortableEngine(config)
    try:
        yield engine
    finally:
        engine.shutdown()


def complete(engine, requests: list, on_emission, spread_s: float = 0.0) -> None:
    """Submit `requests` (evenly over `spread_s` seconds) and wait for each one's final emission;
    `on_emission(index, emission)` runs on the engine's thread."""
    done = threading.Semaphore(0)
    for i, request in enumerate(requests):

        def emit(emission, i=i) -> None:
            on_emission(i, emission)
            if emission.final:
                done.release()

        engine.submit(request, emit)
        time.sleep(spread_s / len(requests))
    for _ in requests:
        done.acquire()


def generated(engine, requests: list, at_once: bool) -> list[list[int]]:
    """Each request's generated tokens: all submitted at once, or one after the other."""
    outputs: list[list[int]] = [[] for _ in requests]

    def collect(i: int, emission) -> None:
        assert emission.error is None, emission.error
        outputs[i].extend(emission.token_ids)

    if at_once:
        complete(engine, requests, collect)
    else:
        for i, request in enumerate(requests):
            complete(engine, [request], lambda _, emission, i=i: collect(i, emission))
    return outputs


def contains_word(prompt: list[int], tokens: list[int], word: tuple[int, ...]) -> bool:
    """Whether a generated token completes `word` (its earlier tokens may lie in the prompt)."""
    text = prompt[-(len(word) - 1) :] + tokens if len(word) > 1 else tokens
    return any(tuple(text[j : j + len(word)]) == word for j in range(len(text) - len(word) + 1))


def equivalence_cases(ids: list[list[int]], reference: list[list[int]], tokens: int) -> dict[str, tuple[list, bool]]:
    """Requests whose tokens every engine setting must agree on: (requests, submitted at once). Bad words come
    from the greedy `reference` tokens, so each ban changes the answer: a single token the answer reached at
    its 6th token, and its 3rd and 4th tokens as a two-token word. The mixed batch interleaves greedy, seeded
    sampling and bad words in one streaming batch, the case asynchronous batching prepares a step ahead for."""
    from tritonllm.engine.api import GenerationRequest, SamplingParams

    def words(r: list[int]) -> tuple[tuple[int, ...], ...]:
        return ((r[5],), (r[2], r[3]))

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=seed)

    n = len(reference)
    mixed = [
        GenerationRequest(
            ids[i],
            tokens,
            sampling=sampled(i) if i % 3 == 1 else SamplingParams(),
            bad_words=words(reference[i]) if i % 3 == 2 else (),
            streaming=True,
        )
        for i in range(n)
    ]
    return {
        "greedy_c1": ([GenerationRequest(ids[i], tokens) for i in range(4)], False),
        f"greedy_c{n}": ([GenerationRequest(ids[i], tokens) for i in range(n)], True),
        f"bad_words_c{n}": ([GenerationRequest(ids[i], tokens, bad_words=words(reference[i])) for i in range(n)], True),
        f"sampled_c{n}": ([GenerationRequest(ids[i], tokens, sampling=sampled(i)) for i in range(n)], True),
        f"mixed_streaming_c{n}": (mixed, True),
    }


def equivalence(model_dir: Path, ids: list[list[int]], variants: list[dict], seq_len: int, reference: list) -> dict:
    """Token-for-token agreement of engine settings on the same requests: for each case
    and setting, the requests whose tokens equal the first setting's and where the others first differ, and
    bad words found in an answer (which must be none). `reference` is plain `generate`'s greedy tokens for
    the same prompts; greedy_c1 is compared with it too."""
    tokens = len(reference[0])
    cases = equivalence_cases(ids, reference, tokens)
    first: dict[str, list[list[int]]] = {}
    report: dict = {}
    for options in variants:
        row: dict = {}
        with cuda_engine(model_dir, len(reference), seq_len, options) as engine:
            for case, (requests, at_once) in cases.items():
                out = generated(engine, requests, at_once)
                base = first.setdefault(case, out)
                if case == "greedy_c1":
                    row["greedy_c1_vs_generate"] = agreement(out, reference[: len(out)])
                row[case] = agreement(out, base)
                if any(r.bad_words for r in requests):
                    row[case]["bad_words_found"] = sum(
                        contains_word(r.input_ids, o, w)
                        for r, o in zip(requests, out, strict=True)
                        for w in r.bad_words
                    )
        report[json.dumps(options, sort_keys=True)] = row
        print(json.dumps(row), flush=True)
    return report


def agreement(out: list[list[int]], base: list[list[int]]) -> dict:
    """How many answers equal `base`'s, and for the others the first token where they differ."""
    differ = [
        next((j for j, (a, b) in enumerate(zip(o, b_, strict=False)) if a != b), min(len(o), len(b_)))
        for o, b_ in zip(out, base, strict=True)
        if o != b_
    ]
    return {"same": f"{len(out) - len(differ)}/{len(out)}", "first_difference_at": sorted(differ)}


def greedy_reference(model, ids: list[list[int]], tokens: int) -> list[list[int]]:
    """Plain `generate`'s greedy tokens, one prompt at a time."""
    out = []
    for prompt in ids:
        options = {"do_sample": False, "max_new_tokens": tokens, "min_new_tokens": tokens, "pad_token_id": 0}
        result = model.generate(torch.tensor([prompt], device=model.device), **options)
        out.append(result[0, len(prompt) :].tolist())
    return out


def kernel_profile(engine, ids: list[int], out: Path, tokens: int = 32) -> dict | str:
    """One stream of `tokens` under torch's profiler: its device kernels, heaviest first, go to `out`; returns
    per generated token the device's busy time and its idle time (see device_idle), against the step's wall
    time in "c1"."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_engine(engine, [[ids]], tokens)
        averages = prof.key_averages()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(averages.table(sort_by="self_device_time_total", row_limit=60))
        kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
        return {
            "kernels": round(len(kernels) / tokens, 1),
            **{f"{k}_ms": round(v / 1000 / tokens, 3) for k, v in device_idle(kernels).items()},
        }
    except Exception as exc:  # a profiler that fails must not cost the measurement
        return f"failed: {exc!r}"[:200]


def device_idle(kernels: list[tuple[float, float]], step_gap_us: float = 100.0) -> dict[str, float]:
    """From kernels' (start, end) in microseconds: the time the device was busy, and its idle time split at
    `step_gap_us` into gaps inside a step (between a captured graph's kernels) and gaps between steps (the
    host's turn: reading tokens, preparing the next step)."""
    busy = inside = between = 0.0
    reached = min(start for start, _ in kernels)
    for start, end in sorted(kernels):
        gap = start - reached
        if gap > step_gap_us:
            between += gap
        elif gap > 0:
            inside += gap
        busy += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return {"busy": busy, "idle_inside_steps": inside, "idle_between_steps": between}


def sampling_ms(rows: int, vocab: int) -> float:
    """Time of the sampling processors' tensor work for `rows` rows (paid every step under CUDA graphs)."""
    from tritonllm.engine.logits import sample

    scores = torch.randn(rows, vocab, device="cuda")
    ones = torch.ones(rows, device="cuda")
    args = (ones, torch.zeros(rows, dtype=torch.int32, device="cuda"), ones, torch.arange(rows, device="cuda"))
    for _ in range(3):
        sample(scores, *args)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        sample(scores, *args)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / 20 * 1000


def varlen_check() -> dict:
    """tritonllm/engine/attention.py's FlashAttention call against per-request SDPA in float32 (as its unit test),
    on steps shaped like the batching manager's: prefill chunks after cached tokens, decode steps, padding."""
    from benchmarks.attention_reference import reference_kernel
    from tritonllm.engine.attention import varlen_attention

    torch.manual_seed(0)
    q_lens, k_lens = [128, 1, 1, 37, 0], [128, 200, 5, 300, 0]
    cu_q = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *np.cumsum(k_lens)], dtype=torch.int32, device="cuda")
    query = torch.randn(1, 28, sum(q_lens) + 16, 128, device="cuda", dtype=torch.bfloat16)  # 16 padded rows
    key, value = torch.randn(2, 1, 4, sum(k_lens), 128, device="cuda", dtype=torch.bfloat16)
    scale = 128**-0.5
    out, _ = varlen_attention(
        None,
        query,
        key,
        value,
        None,
        scaling=scale,
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=max(q_lens),
        max_length_k=max(k_lens),
    )
    rows = sum(q_lens)
    qkv = (t.squeeze(0).transpose(0, 1).float().cpu() for t in (query, key, value))
    expected = reference_kernel(*qkv, cu_q.cpu(), cu_k.cpu(), max(q_lens), max(k_lens), scale, (-1, 0))
    error = (out[0, :rows].float().cpu() - expected[:rows]).abs()
    return {"max_abs_error": round(error.max().item(), 4), "mean_abs_error": round(error.mean().item(), 5)}


def generate_batch_1(model, ids: list[int], tokens: int) -> float:
    """Plain `generate`, batch 1: the single-stream baseline."""
    prompt = torch.tensor([ids], device="cuda")
    options = {"do_sample": False, "max_new_tokens": tokens, "min_new_tokens": tokens, "pad_token_id": 0}
    model.generate(prompt, **options)
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(prompt, **options)
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - started)


async def served(
    grpc_url: str,
    ids_text: list[str],
    output_tokens: int,
    concurrency: int,
    sampled=False,
    streaming=True,
    ends: list[float] | None = None,
    leaving: frozenset[int] = frozenset(),
) -> dict:
    """Streams through tensorrt_llm_bls, or (streaming=False) whole answers from the ensemble.
    `ends` collects each request's end time as it finishes (what a stalled run got done); the streams numbered in
    `leaving` cancel their call after its first response, as a client that goes away does."""
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio

    from tritonllm.protocol import infer_inputs

    client = grpcaio.InferenceServerClient(grpc_url)
    jobs = iter(range(len(ids_text)))
    counts, firsts, rates = [], [], []  # rates: a stream's tokens/s after its first
    left = []
    ends = [] if ends is None else ends

    async def one(i: int) -> None:
        tensors = [
            ("text_input", np.array([[ids_text[i].encode()]], dtype=object), "BYTES"),
            ("max_tokens", np.array([[output_tokens]], np.int32), "INT32"),
            ("end_id", np.array([[-1]], np.int32), "INT32"),
            ("return_num_output_tokens", np.array([[True]]), "BOOL"),
        ]
        if streaming:
            tensors.append(("stream", np.array([[True]]), "BOOL"))
        if sampled:
            tensors += [
                ("temperature", np.array([[0.8]], np.float32), "FP32"),
                ("top_p", np.array([[0.95]], np.float32), "FP32"),
                ("seed", np.array([[i]], np.uint64), "UINT64"),
            ]
        inputs = infer_inputs(grpcclient, tensors)

        async def requests():
            yield {"model_name": "tensorrt_llm_bls", "inputs": inputs, "request_id": uuid.uuid4().hex}

        start, first = time.perf_counter(), None
        if not streaming:
            result = await client.infer("ensemble", inputs)
            counts.append(int(result.as_numpy("num_output_tokens").reshape(-1)[0]))
            firsts.append(time.perf_counter() - start)  # whole answers: the time to the last token
            ends.append(time.perf_counter())
            return
        call = client.stream_infer(requests())
        async for result, error in call:
            if error is not None:
                raise RuntimeError(error.message())
            if first is None:
                first = time.perf_counter() - start
            if i in leaving:
                call.cancel()
                left.append(i)
                ends.append(time.perf_counter())
                return
            n = result.as_numpy("num_output_tokens")
            if n is not None:
                counts.append(int(n.reshape(-1)[0]))
        firsts.append(first)
        ends.append(time.perf_counter())
        if counts[-1] > 1 and ends[-1] - start > first:
            rates.append((counts[-1] - 1) / (ends[-1] - start - first))

    async def worker():
        for i in jobs:
            await one(i)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.close()
    return {
        "output_tokens_per_s": round(sum(counts) / elapsed, 1),
        "requests": len(counts),
        **({"left": len(left)} if leaving else {}),
        "ttft_p50_ms": round(float(np.percentile(firsts, 50)) * 1000, 1),
        **({"decode_tokens_per_s": round(float(np.percentile(rates, 50)), 1)} if rates else {}),
        "seconds": round(elapsed, 2),
    }


def cpu_seconds(server) -> dict[str, float]:
    """CPU seconds (user + system) used so far by tritonserver, each stub process and this client."""

    pids = {"tritonserver": server.process.pid, "client": os.getpid()}
    pids.update((f"{model} {pid}", pid) for model, pid in stub_pids())
    return {name: process_cpu_seconds(pid) for name, pid in pids.items()}


@contextlib.contextmanager
def cores_used(server, into: dict):
    """into["cores"]: each process's CPU seconds per second of the block (1.0: one core busy all the time)."""
    before, started = cpu_seconds(server), time.perf_counter()
    try:
        yield
    finally:
        after, elapsed = cpu_seconds(server), time.perf_counter() - started
        into["cores"] = {name: round((after[name] - before.get(name, 0.0)) / elapsed, 2) for name in after}


def stall_report(server, out: Path | None) -> dict:
    """What a stalled server is doing: its queue and load gauges, and (with py-spy) every stub thread's stack."""
    import subprocess

    report = {
        "metrics": [
            line
            for line in server.metrics().splitlines()
            if not line.startswith("#") and "_bucket" not in line and ("pending" in line or "tritonllm" in line)
        ]
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for model, pid in stub_pids():
            dump = subprocess.run(["py-spy", "dump", "--native", "--pid", pid], capture_output=True, text=True)
            (out / f"stall-{model}-{pid}.txt").write_text(dump.stdout + dump.stderr)
    return report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpubench"))
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="the random model's and every engine's; float32 for --equivalence, where bfloat16's rounding makes "
        "any change of kernel (a batch of another size) flip near-tied tokens of a random model",
    )
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--only-in-process", action="store_true")
    parser.add_argument("--served-throughput-only", action="store_true", help="served: only the full-load run")
    parser.add_argument(
        "--build-variants",
        default="[[]]",
        help="JSON list of build_engines.py argument lists, one served measurement each: "
        "'[[], [\"--no-cuda-graphs\"]]'; NAME=VALUE entries set the server's environment instead",
    )
    parser.add_argument("--step-timeout", type=float, default=180, help="seconds a served measurement may take")
    parser.add_argument(
        "--variants",
        # the build's CUDA defaults without and with graphs
        default='[{"cuda_graphs": false, "attention": "varlen"}, '
        '{"cuda_graphs": true, "attention": "varlen", "async_batching": true}]',
        help="JSON list of EngineConfig options, one in-process measurement each",
    )
    parser.add_argument(
        "--equivalence",
        action="store_true",
        help="instead of measuring speed: compare the tokens of the --variants settings (greedy, bad words, "
        "seeded sampling, a mixed streaming batch) with each other and greedy ones with plain generate",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="record py-spy profiles (collapsed stacks) of the serving stubs here, and in-process the device "
        "kernels of one stream (torch profiler)",
    )
    parser.add_argument(
        "--profile-native",
        action="store_true",
        help="profiles with C/C++ frames (py-spy --native): py-spy must then stop the process for each sample, "
        "so they are taken at 50 Hz and slow what they measure",
    )
    args = parser.parse_args()
    if args.profile_native:
        SPY_OPTIONS[:] = ["--native", "--rate", "50"]  # py-spy has no native frames without stopping the process
    from transformers import AutoTokenizer

    model_dir = args.work / "qwen7b-random"
    model = make_model(model_dir, args.tokenizer_dir, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    ids = prompts(tokenizer, args.requests, args.prompt_tokens)
    report = {
        "gpu": torch.cuda.get_device_name(),
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
    }
    import transformers

    report["transformers"] = transformers.__version__
    report["flash_attn"] = importlib.util.find_spec("flash_attn") is not None
    seq_len = args.prompt_tokens + args.output_tokens + 64
    variants = [{"dtype": args.dtype, **options} for options in json.loads(args.variants)]
    if args.equivalence:
        report["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32  # float32 must mean float32 here
        reference = greedy_reference(model, ids[:EQUIVALENCE_REQUESTS], EQUIVALENCE_TOKENS)
        model.save_pretrained(model_dir)
        del model
        torch.cuda.empty_cache()
        report["equivalence"] = equivalence(model_dir, ids, variants, seq_len, reference)
        print(json.dumps(report), flush=True)
        return 0
    if not args.skip_in_process:
        report["generate_batch_1"] = round(generate_batch_1(model, ids[0], 64), 1)
        try:
            report["varlen_check"] = varlen_check()
        except Exception as exc:
            report["varlen_check"] = f"failed: {exc!r}"[:300]
        report[f"sampling_ms_{args.requests}_rows"] = round(sampling_ms(args.requests, QWEN_7B["vocab_size"]), 2)
    started = time.perf_counter()
    model.save_pretrained(model_dir)
    report["save_s"] = round(time.perf_counter() - started, 1)
    del model
    torch.cuda.empty_cache()
    if not args.skip_in_process:
        for n, options in enumerate(variants):
            key = "in_process " + json.dumps(options, sort_keys=True)
            try:
                profile = args.profile_dir / f"in_process{n}" if args.profile_dir else None
                report[key] = in_process(model_dir, ids, args.output_tokens, options, seq_len, profile)
            except Exception as exc:  # one failing variant must not cost the others
                report[key] = f"failed: {exc!r}"[:300]
            print(json.dumps(report), flush=True)
        if args.only_in_process:
            return 0

    texts = [tokenizer.decode(i) for i in ids]
    for n, build_args in enumerate(json.loads(args.build_variants)):
        key = "served " + " ".join(build_args) if build_args else "served"
        try:
            report[key] = serve_and_measure(args, model_dir, seq_len, texts, build_args, args.work / f"build{n}")
        except Exception as exc:  # a server that does not start must not cost the other variants
            report[key] = f"failed: {exc!r}"[-600:]
        print(json.dumps(report), flush=True)
    return 0


def split_environment(build_args: list[str]) -> tuple[dict[str, str], list[str]]:
    """A --build-variants entry's NAME=VALUE items (the server's environment) and its build_engines.py arguments,
    flag values included."""
    settings = [a for a in build_args if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", a)]
    return dict(a.split("=", 1) for a in settings), [a for a in build_args if a not in settings]


def serve_and_measure(
    args, model_dir: Path, seq_len: int, texts: list[str], build_args: list[str], build: Path
) -> dict:
    """Build a repository with `build_args`, start tritonserver on it and measure; a stalled step is reported."""
    from tritonllm.launch.tritonserver import TritonServer
    from tritonllm.repository.builder import main as build_main

    env, build_args = split_environment(build_args)
    code = build_main(
        [
            "--model",
            str(model_dir),
            "--build-dir",
            str(build),
            "--device",
            "cuda",
            "--dtype",
            args.dtype,
            "--max-batch-size",
            str(args.requests),
            "--max-queue-size",
            str(args.requests),
            "--max-seq-len",
            str(seq_len),
            "--max-input-len",
            str(args.prompt_tokens + 32),
            "--kv-cache-gib",
            "40",
            "--max-batch-tokens",
            "4096",
            *build_args,
        ]
    )
    assert code == 0
    log = build / "server.log"
    server = TritonServer.on_free_ports(build, log_file=log)
    started = time.perf_counter()
    with mock.patch.dict(os.environ, env):  # the server and its stubs inherit the environment at start
        server.start(timeout=540)
    result: dict = {"server_ready_s": round(time.perf_counter() - started, 1)}
    grpc_url = f"{server.host}:{server.grpc_port}"
    profile = args.profile_dir / build.name if args.profile_dir else None
    everything = f"c{args.requests}"
    graphs = 0  # the engine's CUDA graphs after the previous load

    def measure(label: str, texts: list[str], concurrency: int, **options) -> None:
        nonlocal graphs
        ends: list[float] = []
        run = served(grpc_url, texts, args.output_tokens, concurrency, ends=ends, **options)
        try:
            result[label] = asyncio.run(asyncio.wait_for(run, args.step_timeout))
            before, graphs = graphs, served_graphs(server)
            result[label]["graphs"] = f"{before} -> {graphs}"
        except (TimeoutError, asyncio.TimeoutError):
            result[label] = f"{len(ends)} of {len(texts)} requests finished in {args.step_timeout} s"
            result["stall"] = stall_report(server, args.profile_dir)
            raise
        finally:
            print(label, json.dumps(result.get(label)), flush=True)

    try:
        asyncio.run(served(grpc_url, texts[:8], 8, 8))  # warm-up
        graphs = served_graphs(server)
        if not args.served_throughput_only:
            with profiled(profile, "c1", seconds=8):
                measure("c1", texts[:3], 1)
            measure(everything + "_first", texts, args.requests)
        for label, streaming in ((everything, True), (everything + "_ensemble", False)):
            extra: dict = {}
            with (
                profiled(profile if streaming else None, everything, seconds=12),
                timeline(lambda: engine_gauges(server), extra),
                cores_used(server, extra),
            ):
                measure(label, texts, args.requests, streaming=streaming)
            if isinstance(result.get(label), dict):
                result[label].update(extra)
        if not args.served_throughput_only:
            # the first sampled load captures the sampled steps' graphs (their key differs from greedy's)
            for label in (everything + "_sampled_first", everything + "_sampled"):
                measure(label, texts, args.requests, sampled=True)
    except (TimeoutError, asyncio.TimeoutError):
        result["server_log_tail"] = log.read_text()[-3000:] if log.exists() else "(no log)"
    finally:
        server.stop()
    return result


if __name__ == "__main__":
    raise SystemExit(main())
