"""Integration: a soak of 400 mixed requests at concurrency 32 (streaming and not, short and long).

Zero failures of valid requests; afterwards the engine reports nothing in flight; the resident
memory of the Python-backend processes grows by at most MEMORY_BOUND_MB from the end of the first
half to the end of the second (after 200 requests, every code path and buffer size has been used,
so more growth would be a leak).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio

from benchmarks.loadgen import load_prompts
from client import infer_inputs, request_tensors
from tests.integration.test_streaming import wait_for_in_flight

pytestmark = pytest.mark.integration
REQUESTS = 400
CONCURRENCY = 32
MEMORY_BOUND_MB = 64


def stub_rss_mb(server) -> float:
    """Resident memory of every Python-backend stub of this server."""
    pids = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True).stdout.split()
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        except (FileNotFoundError, StopIteration):
            continue
    return total / 1024


async def soak(server, count: int, seed: int) -> list[str]:
    """`count` mixed requests; returns the failures."""
    rng = random.Random(seed)
    prompts = load_prompts()
    grpc = grpcaio.InferenceServerClient(f"{server.host}:{server.grpc_port}")
    http = httpaio.InferenceServerClient(server.http_url, conn_limit=CONCURRENCY)
    jobs = iter(range(count))
    failures: list[str] = []

    async def one(i: int) -> None:
        max_tokens = rng.choice([24, 32]) if rng.random() < 0.1 else rng.randint(1, 6)
        tensors = request_tensors(rng.choice(prompts), max_tokens, chat=rng.random() < 0.25)
        if i % 2:
            tensors.append(("stream", np.array([[True]]), "BOOL"))
            inputs = infer_inputs(grpcclient, tensors)

            async def requests():
                yield {"model_name": "tensorrt_llm_bls", "inputs": inputs, "request_id": uuid.uuid4().hex}

            final = False
            async for result, error in grpc.stream_infer(requests()):
                # Read the stream to its end (the server closes it after the final response): leaving
                # the loop early would cancel the call just after it (docs/deploy.md, "Faults and the watchdog").
                if error is not None:
                    failures.append(f"stream {i}: {error.message()}")
                final = final or (result is not None and result.as_numpy("finish_reason") is not None)
            if not final and not failures:
                failures.append(f"stream {i}: ended without a final response")
        else:
            try:
                result = await http.infer("ensemble", infer_inputs(httpclient, tensors))
                assert result.as_numpy("text_output") is not None
            except Exception as exc:
                failures.append(f"ensemble {i}: {exc}")

    async def worker() -> None:
        for i in jobs:
            await one(i)

    try:
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    finally:
        await grpc.close()
        await http.close()
    return failures


def test_soak(server):
    first = asyncio.run(soak(server, REQUESTS // 2, seed=1))
    assert wait_for_in_flight(server, 0) == 0
    after_first = stub_rss_mb(server)
    second = asyncio.run(soak(server, REQUESTS // 2, seed=2))
    assert first + second == [], (first + second)[:5]
    assert wait_for_in_flight(server, 0) == 0, "the engine still reports requests after the soak"
    growth = stub_rss_mb(server) - after_first
    half = REQUESTS // 2
    print(f"soak: Python-backend memory {after_first:.0f} MB after {half} requests, {growth:+.1f} MB after {REQUESTS}")
    assert growth <= MEMORY_BOUND_MB, f"Python-backend memory grew {growth:.1f} MB over the second {half} requests"
