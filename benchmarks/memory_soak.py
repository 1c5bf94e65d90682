"""Memory soak: does any server process keep growing under a long mixed load (Triton's qa/L0_memory_growth, here)?

Starts tritonserver on BUILD's repository (and the OpenAI layer, unless --kinds leaves it out) on free loopback
ports, warms every request kind up at the soak's concurrency (so caches, arenas and buffers reach their working
size), then sends a seeded mix for --seconds (or --requests), --concurrency at a time: streams (`tensorrt_llm_bls`,
gRPC), whole answers (`ensemble`, HTTP), streams the client cancels after their first response, guided answers
(regex, grammar, JSON schema), sampled ones, prompts near the build's input limit, HTTP requests whose socket closes
before the answer, and OpenAI chat streams. The resident memory (VmRSS) of tritonserver and of each process under
it (every Python-backend stub, by the model it serves; an engine process) and of the OpenAI layer is read after the
warm-up, at --samples points during the soak and at its end.

PASS when every process grew by at most --bound-mib, every valid request succeeded (cancelled and disconnected ones
end early by design: they must not fail later ones), and afterwards the engine holds nothing, answers its probe and
a plain request, the server log has no traceback and the server stops cleanly. Exit status 0 only on PASS.

  python -m benchmarks.memory_soak --build-dir build --seconds 600 --concurrency 16     # make soak
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
import uuid
from collections import Counter
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio

from benchmarks.loadgen import load_prompts
from benchmarks.procs import children
from tritonllm.launch.tritonserver import metric_samples, metric_value, probe_engine
from tritonllm.protocol import ENSEMBLE, FINISH_REASONS, STREAMING_MODEL, infer_inputs, request_tensors

# One block of the mix: each kind this many times, shuffled; any block holds every kind.
BLOCK = {"stream": 5, "whole": 4, "cancel": 3, "guided": 2, "sampled": 3, "long": 1, "disconnect": 2, "openai": 2}
EARLY_END = ("cancel", "disconnect")  # kinds the client ends on purpose before the answer is complete
# (guide type, guide, check of the answer): short guides that end with the end id well within max_tokens.
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"]}
GUIDES = [
    ("regex", r"[0-9]{4}-[0-9]{2}", lambda text: re.fullmatch(r"[0-9]{4}-[0-9]{2}", text) is not None),
    ("ebnf_grammar", 'root ::= "yes" | "no"', lambda text: text in ("yes", "no")),
    ("json_schema", json.dumps(CITY), lambda text: json.loads(text).get("city") in CITY["properties"]["city"]["enum"]),
]
MiB = 1024
FINISHED, ERRORS = "tritonllm_requests_finished_total", "tritonllm_request_errors_total"
ERROR_KINDS = ("invalid_input", "server_busy", "generation_failed")  # docs/deploy.md, Metrics


def request_kinds(seed: int, kinds: Collection[str] = tuple(BLOCK)) -> Iterator[str]:
    """The soak's kinds, endlessly: seeded shuffles of BLOCK's share of each of `kinds` (a subset, to tell which
    kind makes a process grow)."""
    rng = random.Random(seed)
    block = [kind for kind, n in BLOCK.items() if kind in kinds for _ in range(n)]
    while True:
        rng.shuffle(block)
        yield from block


def vm_rss_kib(status: str) -> int | None:
    """VmRSS in KiB from the text of /proc/PID/status (None for a zombie, which has no memory line)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


def process_name(cmdline: bytes) -> str:
    """What a server process is, from its /proc/PID/cmdline: the model a Python-backend stub serves (its first
    argument is <repository>/<model>/<version>/model.py), the engine's own process, or its program's name."""
    args = [arg.decode(errors="replace") for arg in cmdline.split(b"\0") if arg]
    if not args:
        return "?"
    if args[0].endswith("python_backend_stub") and len(args) > 1 and args[1].endswith("model.py"):
        return f"stub {args[1].split('/')[-3]}"
    if "tritonllm.engine.process" in args:
        return "engine process"
    if "tritonllm.openai.app" in args:
        return "openai layer"
    return args[0].rsplit("/", 1)[-1]


def process_tree(roots: list[int]) -> dict[str, int]:
    """'name [pid]' -> pid of `roots` (first) and every process under them (by name)."""
    found: dict[str, int] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop(0)
        try:
            name = process_name(Path(f"/proc/{pid}/cmdline").read_bytes())
            todo += children(pid)
        except OSError:
            continue
        found[f"{name} [{pid}]"] = pid
    first = list(found)[: len(roots)]
    return {label: found[label] for label in first + sorted(set(found) - set(first))}


def rss_snapshot(processes: dict[str, int]) -> dict[str, int]:
    """Each live process's VmRSS in KiB (a process gone or defunct is left out)."""
    rss = {}
    for label, pid in processes.items():
        try:
            kib = vm_rss_kib(Path(f"/proc/{pid}/status").read_text())
        except OSError:
            continue
        if kib is not None:
            rss[label] = kib
    return rss


def memory_table(points: list[tuple[str, dict[str, int]]]) -> str:
    """A Markdown table, MiB: one row per process of the first point, one column per point, then the growth."""
    heads = [name for name, _ in points]
    lines = ["| process | " + " | ".join(heads) + " | growth |", "|---" * (len(heads) + 2) + "|"]
    for label in points[0][1]:
        values = [rss.get(label) for _, rss in points]
        cells = [f"{v / MiB:.1f}" if v is not None else "gone" for v in values]
        growth = f"{(values[-1] - values[0]) / MiB:+.1f}" if values[-1] is not None else "gone"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {growth} |")
    return "\n".join(lines)


def verdict(
    points: list[tuple[str, dict[str, int]]], bound_mib: float, failures: list[str], checks: list[str]
) -> tuple[bool, list[str]]:
    """PASS or FAIL, and why: a process of the first point that grew past `bound_mib` by the last or is gone, a
    failed valid request, or a failed check after the soak."""
    first, last = points[0][1], points[-1][1]
    reasons = []
    for label, start in first.items():
        if label not in last:
            reasons.append(f"{label}: gone by the end")
        elif (last[label] - start) / MiB > bound_mib:
            reasons.append(f"{label}: grew {(last[label] - start) / MiB:.1f} MiB, more than {bound_mib:g}")
    if failures:
        reasons.append(f"{len(failures)} valid requests failed")
    return not reasons and not checks, reasons + checks


class Soak:
    """The clients, the prompts and the per-kind request senders; `send` returns None or what went wrong."""

    def __init__(self, server, openai, long_prompts: list[str], timeout: float, concurrency: int) -> None:
        self.server, self.frontend, self.timeout = server, openai, timeout
        self.prompts, self.long_prompts = load_prompts(), long_prompts
        self.grpc = grpcaio.InferenceServerClient(f"{server.host}:{server.grpc_port}")
        self.http = httpaio.InferenceServerClient(server.http_url, conn_limit=concurrency, conn_timeout=timeout)
        self.session = None  # aiohttp, for the OpenAI layer: made inside the running loop

    async def close(self) -> None:
        await self.grpc.close()
        await self.http.close()
        if self.session is not None:
            await self.session.close()

    async def send(self, kind: str, rng: random.Random) -> str | None:
        try:
            return await asyncio.wait_for(getattr(self, kind)(rng), self.timeout)
        except asyncio.TimeoutError:
            return f"no answer in {self.timeout:.0f} s"
        except Exception as exc:  # an HTTP error status, a connection reset: a failure, by its message
            return f"{type(exc).__name__}: {str(exc)[:300]}"

    def tensors(self, rng: random.Random, **options) -> list:
        max_tokens = options.pop("max_tokens", None) or (
            rng.randint(24, 32) if rng.random() < 0.1 else rng.randint(1, 8)
        )
        prompt = options.pop("prompt", None) or rng.choice(self.prompts)
        return request_tensors(prompt, max_tokens, chat=options.pop("chat", rng.random() < 0.5), **options)

    async def streamed(self, tensors: list, cancel: bool = False) -> tuple[str, dict]:
        """A tensorrt_llm_bls stream read to its end (or cancelled after its first response): its text and final
        response's outputs."""
        inputs = infer_inputs(grpcclient, [*tensors, ("stream", np.array([[True]]), "BOOL")])

        async def requests():
            yield {"model_name": STREAMING_MODEL, "inputs": inputs, "request_id": uuid.uuid4().hex}

        text, final = [], {}
        responses = self.grpc.stream_infer(requests())
        async for result, error in responses:
            if error is not None:
                raise RuntimeError(error.message())
            if (piece := result.as_numpy("text_output")) is not None:
                text.append(b"".join(piece.reshape(-1)).decode())
            if result.as_numpy("finish_reason") is not None:
                final = {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
            elif cancel:
                responses.cancel()  # after the first response, not after the final (docs/deploy.md, known issue)
                return "".join(text), {"cancelled": True}
        if not final:
            raise RuntimeError("the stream ended without a final response")
        return "".join(text), final

    async def whole(self, rng: random.Random, **options) -> str | None:
        result = await self.http.infer(ENSEMBLE, infer_inputs(httpclient, self.tensors(rng, **options)))
        return None if result.as_numpy("text_output") is not None else "no text_output"

    async def stream(self, rng: random.Random, **options) -> str | None:
        await self.streamed(self.tensors(rng, **options))
        return None

    async def cancel(self, rng: random.Random) -> str | None:
        await self.streamed(self.tensors(rng, max_tokens=rng.randint(64, 256), end_id=-1), cancel=True)
        return None

    async def guided(self, rng: random.Random) -> str | None:
        kind, guide, valid = rng.choice(GUIDES)
        tensors = self.tensors(rng, max_tokens=32, guided_decoding_guide_type=kind, guided_decoding_guide=guide)
        if rng.random() < 0.5:
            text, final = await self.streamed(tensors)
            reason = final["finish_reason"].reshape(-1)[0]
        else:
            result = await self.http.infer(ENSEMBLE, infer_inputs(httpclient, tensors))
            text = result.as_numpy("text_output").reshape(-1)[0].decode()
            reason = result.as_numpy("finish_reason").reshape(-1)[0]
        try:
            ok = reason == b"eos" and valid(text)
        except ValueError:
            ok = False
        return None if ok else f"{kind} guide: {text!r} (finish {reason!r})"

    async def sampled(self, rng: random.Random) -> str | None:
        options = {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(2**32)}
        return await (self.stream if rng.random() < 0.5 else self.whole)(rng, **options)

    async def long(self, rng: random.Random) -> str | None:
        options = {"prompt": rng.choice(self.long_prompts), "chat": False, "max_tokens": rng.randint(1, 8)}
        return await (self.stream if rng.random() < 0.5 else self.whole)(rng, **options)

    async def disconnect(self, rng: random.Random) -> str | None:
        """An HTTP generate (whole) or generate_stream request whose socket closes before the answer (the stream's
        after its first bytes): tritonserver 2.51 runs the former to its end (docs/deploy.md)."""
        streaming = rng.random() < 0.5
        model, route = (STREAMING_MODEL, "generate_stream") if streaming else (ENSEMBLE, "generate")
        body = {
            "text_input": rng.choice(self.prompts),
            "max_tokens": rng.randint(8, 32),
            **({"stream": True} if streaming else {}),
        }
        data = json.dumps(body).encode()
        head = f"POST /v2/models/{model}/{route} HTTP/1.1\r\nHost: {self.server.http_url}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        reader, writer = await asyncio.open_connection(self.server.host, self.server.http_port)
        writer.write(head.encode() + data)
        await writer.drain()
        if streaming:
            await reader.read(1)
        else:
            await asyncio.sleep(rng.uniform(0.0, 0.2))
        writer.close()
        await writer.wait_closed()
        return None

    async def openai(self, rng: random.Random) -> str | None:
        """A streamed chat completion through the OpenAI layer, read to its [DONE]."""
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession()
        body = {
            "model": self.frontend.served_name,
            "messages": [{"role": "user", "content": rng.choice(self.prompts)}],
            "max_tokens": rng.randint(1, 8),
            "stream": True,
        }
        async with self.session.post(f"{self.frontend.url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                return f"HTTP {response.status}: {(await response.text())[:300]}"
            lines = [line async for line in response.content]
        return None if any(line.strip() == b"data: [DONE]" for line in lines) else "the stream ended without [DONE]"


async def run_mix(soak: Soak, kinds: Iterator[str], seed: int, concurrency: int, stop, outcomes: list) -> None:
    """Requests of `kinds` at `concurrency` until stop(done) is true; (kind, error or None) into `outcomes`. Each
    request's parameters come from its own RNG (seed and index), whatever order the requests finish in."""
    index = iter(range(sys.maxsize))

    async def worker() -> None:
        while not stop(len(outcomes)):
            i, kind = next(index), next(kinds)
            outcomes.append((kind, await soak.send(kind, random.Random(f"{seed}:{i}"))))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def in_flight(server) -> float:
    return metric_value(metric_samples(server.metrics()), "tritonllm_engine_requests_in_flight")


def engine_counts(metrics: str) -> Counter:
    """The engine's finished requests by finish reason and its refused or failed ones by kind, from /metrics."""
    samples = metric_samples(metrics)
    counts = Counter({reason: metric_value(samples, FINISHED, finish_reason=reason) for reason in FINISH_REASONS})
    counts.update({kind: metric_value(samples, ERRORS, kind=kind) for kind in ERROR_KINDS})
    return counts


async def settle(server, timeout: float = 120.0) -> float:
    """Wait until the engine holds nothing (disconnected requests still generate); what it holds then."""
    deadline = time.monotonic() + timeout
    while (held := await asyncio.to_thread(in_flight, server)) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return held


def long_prompts(tokenizer_dir: str, max_input_len: int, prompts: list[str]) -> list[str]:
    """Three prompts of about 75, 88 and 97 % of the build's input limit (its tokens without a chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer("\n".join(prompts * 64), add_special_tokens=False)["input_ids"]
    made = []
    for share in (0.75, 0.88, 0.97):
        text = tokenizer.decode(ids[: int(max_input_len * share)])
        while len(tokenizer(text)["input_ids"]) > max_input_len - 8:  # re-encoding may merge or split
            text = text[: int(len(text) * 0.98)]
        made.append(text)
    return made


async def soak_run(args, server, openai, manifest: dict) -> tuple[list, list[str], list[str]]:
    """Warm-up, soak, memory readings and the checks after it: (memory points, failed requests, failed checks)."""
    prompts = load_prompts()
    longs = long_prompts(manifest["tokenizer_dir"], manifest["max_input_len"], prompts)
    soak = Soak(server, openai, longs, args.request_timeout, args.concurrency)
    roots = [server.process.pid] + ([openai.process.pid] if openai else [])
    points: list[tuple[str, dict[str, int]]] = []
    outcomes: list[tuple[str, str | None]] = []
    try:
        kinds = request_kinds(args.seed, args.kinds)
        warmup = 2 * sum(n for k, n in BLOCK.items() if k in args.kinds)  # every kind at least twice
        await run_mix(soak, kinds, args.seed + 1, args.concurrency, lambda done: done >= warmup, outcomes)
        failures = [f"warm-up {k}: {e}" for k, e in outcomes if e]
        await settle(server)
        processes = process_tree(roots)
        points.append(("start", rss_snapshot(processes)))
        before = engine_counts(await asyncio.to_thread(server.metrics))
        outcomes.clear()
        started = time.monotonic()

        def progress(done: int) -> float:
            return (time.monotonic() - started) / args.seconds if args.seconds else done / args.requests

        async def sampler() -> None:
            for k in range(1, args.samples + 1):
                while progress(len(outcomes)) < k / (args.samples + 1):
                    await asyncio.sleep(0.2)
                points.append((f"{100 * k // (args.samples + 1)} %", rss_snapshot(processes)))

        sampling = asyncio.create_task(sampler())
        await run_mix(soak, kinds, args.seed, args.concurrency, lambda done: progress(done) >= 1, outcomes)
        sampling.cancel()
        elapsed = time.monotonic() - started
        held = await settle(server)
        settled = time.monotonic() - started - elapsed
        points.append(("end", rss_snapshot(processes)))
        counts = engine_counts(await asyncio.to_thread(server.metrics))
        counts.subtract(before)
        checks = [f"the engine still reports {held:g} requests in flight"] if held else []
        if counts["generation_failed"]:
            checks.append(f"the engine counted {counts['generation_failed']:g} failed generations")
        if counts["cancelled"] < (cancels := sum(1 for k, e in outcomes if k == "cancel" and e is None)):
            checks.append(f"{cancels} streams cancelled, but the engine ended only {counts['cancelled']:g} as such")
        if not server.is_ready():
            checks.append("the server is not ready after the soak")
        if (probe := await asyncio.to_thread(probe_engine, f"{server.host}:{server.grpc_port}")) is not None:
            checks.append(f"the engine's probe failed: {probe}")
        if (after := await soak.send("stream", random.Random(0))) is not None:
            checks.append(f"a stream after the soak failed: {after}")
        if new := sorted(set(process_tree(roots)) - set(processes)):
            checks.append(f"processes started during the soak: {new}")
    finally:
        await soak.close()
    failures += [f"{k}: {e}" for k, e in outcomes if e]
    sent = Counter(k for k, _ in outcomes)
    print(f"memory soak: {len(outcomes)} requests in {elapsed:.0f} s, concurrency {args.concurrency}, seed {args.seed}")
    print("requests by kind: " + ", ".join(f"{k} {sent[k]}" for k in BLOCK if sent[k]))
    engine = ", ".join(f"{k} {v:g}" for k, v in counts.items() if v)
    print(f"the engine over the soak ({settled:.1f} s after it to finish what it held): {engine}")
    return points, failures, checks


def main(argv: list[str] | None = None) -> int:
    from tritonllm.launch.tritonserver import OpenAIFrontend, TritonServer, free_port

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", type=Path, default=Path("build"))
    parser.add_argument("--seconds", type=float, default=600.0, help="the soak's length (0: --requests instead)")
    parser.add_argument("--requests", type=int, default=2000, help="the soak's requests when --seconds is 0")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=3, help="memory readings during the soak")
    parser.add_argument("--bound-mib", type=float, default=64.0, help="the growth allowed to each process")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request is a hang")
    parser.add_argument("--kinds", default=",".join(BLOCK), help="the request kinds of the mix, comma-separated")
    parser.add_argument("--out", type=Path, help="the servers' logs (default: BUILD_DIR/memory-soak)")
    args = parser.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if not args.kinds or set(args.kinds) - set(BLOCK):
        parser.error(f"--kinds: choose among {', '.join(BLOCK)}")
    build = args.build_dir.resolve()
    out = (args.out or build / "memory-soak").resolve()
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((build / "manifest.json").read_text())
    log = out / "server.log"
    server = TritonServer.on_free_ports(build, log_file=log)
    openai = None
    if "openai" in args.kinds:
        grpc_url = f"{server.host}:{server.grpc_port}"
        openai = OpenAIFrontend.for_build(
            grpc_url, manifest, free_port(), log_file=out / "openai.log", repository=str(server.repository)
        )
    try:
        server.start(timeout=600)
        if openai:
            openai.start()
        points, failures, checks = asyncio.run(soak_run(args, server, openai, manifest))
    finally:
        if openai:
            openai.stop()
        code = server.stop()
    print(f"\nVmRSS, MiB (after the warm-up, during the soak, at its end):\n{memory_table(points)}\n")
    if code != 0:
        checks.append(f"tritonserver exited with {code} when stopped (killed after 30 s: a hang at unload?)")
    if tracebacks := log.read_text(errors="replace").count("Traceback"):
        checks.append(f"{tracebacks} tracebacks in the server log ({log})")
    passed, reasons = verdict(points, args.bound_mib, failures, checks)
    for failure in failures[:10]:
        print("  failed:", failure)
    bound = f"every process grew by at most {args.bound_mib:g} MiB, every valid request succeeded"
    print(f"{'PASS' if passed else 'FAIL'}: " + ("; ".join(reasons) or bound + ", the engine is idle after it"))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
