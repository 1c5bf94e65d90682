"""Hunt for crashes and stalls of the streaming path: rounds of many short streams at high concurrency.

Starts tritonserver on BUILD (a `build_engines.py` folder whose engine admits the concurrency,
e.g. `--max-batch-size 64 --max-queue-size 256`) and streams ROUNDS x REQUESTS prompts through
`tensorrt_llm_bls`, CONCURRENCY at a time, TOKENS each. A round that does not finish in time, or a
stream that fails, ends the run with a stall report (queue and load gauges; with py-spy on PATH,
every stub thread's stack under build/stall/). Exit status 0 only when every round finished.

  python benchmarks/stress_streams.py BUILD --concurrency 256 --requests 512 --tokens 8 --rounds 15
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
from tritonllm.launch.tritonserver import TritonServer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("build", type=Path)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=512, help="streams per round")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--round-timeout", type=float, default=300)
    args = parser.parse_args()
    prompts = load_prompts()
    texts = [prompts[i % len(prompts)] for i in range(args.requests)]
    server = TritonServer.on_free_ports(args.build, log_file=args.build / "stress-server.log")
    server.start(timeout=600)
    grpc_url = f"{server.host}:{server.grpc_port}"
    try:
        for n in range(args.rounds):
            ends: list[float] = []
            started = time.perf_counter()
            try:
                result = asyncio.run(
                    asyncio.wait_for(
                        served(grpc_url, texts, args.tokens, args.concurrency, ends=ends), args.round_timeout
                    )
                )
            except Exception as exc:  # a timeout or a failed stream: say what the server is doing
                print(f"round {n}: {len(ends)} of {len(texts)} streams finished, then {exc!r}", flush=True)
                print(json.dumps(stall_report(server, args.build / "stall"), indent=1), flush=True)
                return 1
            print(f"round {n}: {len(texts)} streams in {time.perf_counter() - started:.1f} s, {result}", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
