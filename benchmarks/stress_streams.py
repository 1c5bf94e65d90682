"""Hunt for crashes and stalls of the streaming path: rounds of many short streams at high concurrency.

Starts tritonserver on BUILD (a `build_engines.py` folder whose engine admits the concurrency,
e.g. `--max-batch-size 64 --max-queue-size 256`) and streams ROUNDS x REQUESTS prompts through
`tensorrt_llm_bls`, CONCURRENCY at a time, TOKENS each. A round that does not finish in time, or a
stream that fails, ends the run with a stall report (queue and load gauges; with py-spy on PATH,
every stub thread's stack under build/stall/). With --leave F, that share of the streams (evenly spread) cancel
their call after the first response, as clients that go away do; after each round the engine must hold no request
(its gauges back to 0) and have finished every stream of it, each with a finish reason (its finished-requests
counter up by the round's streams: `length` for the others, `cancelled` or `length` for those that left). Exit
status 0 only when every round finished and accounted for every stream.

  python benchmarks/stress_streams.py BUILD --concurrency 256 --requests 512 --tokens 8 --rounds 15
  python benchmarks/stress_streams.py BUILD --concurrency 1024 --requests 2048 --tokens 64 --leave 0.15 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: `benchmarks` is not installed
from benchmarks.gpu_bench import served, stall_report  # the GPU bench's load and its stall report
from benchmarks.loadgen import load_prompts
from tritonllm.launch.tritonserver import TritonServer, metric_samples, metric_value
from tritonllm.protocol import FINISH_REASONS

DRAIN_SECONDS = 60  # for the engine to finish what the round's clients left


def leavers(streams: int, share: float) -> frozenset[int]:
    """floor(streams * share) stream numbers, evenly spread."""
    return frozenset(i for i in range(streams) if int((i + 1) * share) > int(i * share))


def finished(samples: dict[str, float]) -> dict[str, float]:
    return {r: metric_value(samples, "tritonllm_requests_finished_total", finish_reason=r) for r in FINISH_REASONS}


def finished_since(samples: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {r: int(n - before[r]) for r, n in finished(samples).items() if n > before[r]}


def accounted(server, before: dict[str, float], streams: int) -> str:
    """'' once the engine holds nothing and finished at least `streams` more requests than `before`; else what is
    missing."""
    deadline = time.monotonic() + DRAIN_SECONDS
    while True:
        samples = metric_samples(server.metrics())
        held = metric_value(samples, "tritonllm_engine_requests_in_flight")
        ended = finished_since(samples, before)
        if not held and sum(ended.values()) >= streams:  # a health probe may add its own
            return ""
        if time.monotonic() > deadline:
            return f"after {DRAIN_SECONDS} s the engine holds {held:.0f} requests and finished {ended} of {streams}"
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("build", type=Path)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=512, help="streams per round")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--round-timeout", type=float, default=300)
    parser.add_argument("--leave", type=float, default=0.0, help="share of the streams that cancel after a token")
    args = parser.parse_args()
    leaving = leavers(args.requests, args.leave)
    prompts = load_prompts()
    texts = [prompts[i % len(prompts)] for i in range(args.requests)]
    server = TritonServer.on_free_ports(args.build, log_file=args.build / "stress-server.log")
    server.start(timeout=600)
    grpc_url = f"{server.host}:{server.grpc_port}"
    try:
        for n in range(args.rounds):
            ends: list[float] = []
            before, started = finished(metric_samples(server.metrics())), time.perf_counter()
            try:
                load = served(grpc_url, texts, args.tokens, args.concurrency, ends=ends, leaving=leaving)
                result = asyncio.run(asyncio.wait_for(load, args.round_timeout))
            except Exception as exc:  # a timeout or a failed stream: say what the server is doing
                print(f"round {n}: {len(ends)} of {len(texts)} streams finished, then {exc!r}", flush=True)
                print(json.dumps(stall_report(server, args.build / "stall"), indent=1), flush=True)
                return 1
            print(f"round {n}: {len(texts)} streams in {time.perf_counter() - started:.1f} s, {result}", flush=True)
            if missing := accounted(server, before, len(texts)):
                print(f"round {n}: {missing}", flush=True)
                print(json.dumps(stall_report(server, args.build / "stall"), indent=1), flush=True)
                return 1
            ended = finished_since(metric_samples(server.metrics()), before)
            print(f"round {n}: every stream finished in the engine: {ended}", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
