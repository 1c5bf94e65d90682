"""KV-aware routing against round-robin: a Dynamo fleet of two workers on this machine under a shared-prefix load.

One fleet (tritonllm/dynamo/fleet.py: two `tritonllm dynamo-worker`s on the prefix-cache build) behind two of
Dynamo's frontends on the same workers, one routing by KV cache (`--router-mode kv`, the workers' KV events) and one
round-robin. Each round sends, through each frontend in turn (the order alternates between rounds), a streamed chat
load in which every request begins with one of --prefixes long system prompts (new ones each round and frontend, so
neither finds the other's cache warm) and ends with a question of its own. Printed per router: time to first token
(p50, p90), the share of prompt tokens the workers' prefix caches served (usage's cached tokens), and the load's
duration; medians over the rounds, with their spread.

  python -m benchmarks.fleet --build-dir build/fleet --rounds 3        # make bench-fleet
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import openai

from tritonllm.dynamo.fleet import Fleet, Process
from tritonllm.launch.tritonserver import free_port

WORDS = ["river", "mountain", "library", "window", "garden", "station", "harbor", "lantern", "meadow", "bridge"]


def system_prompt(rng: random.Random, words: int) -> str:
    return "You answer questions about this text in one sentence. " + " ".join(rng.choices(WORDS, k=words))


async def load(url: str, model: str, prefixes: list[str], requests: int, concurrency: int, max_tokens: int) -> dict:
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    first_tokens: list[float] = []
    prompt_tokens = cached_tokens = 0
    gate = asyncio.Semaphore(concurrency)
    order = [i % len(prefixes) for i in range(requests)]
    random.Random(len(prefixes)).shuffle(order)

    async def one(i: int) -> None:
        nonlocal prompt_tokens, cached_tokens
        messages = [
            {"role": "system", "content": prefixes[order[i]]},
            {"role": "user", "content": f"Question {i}: which word comes first?"},
        ]
        async with gate:
            began = time.perf_counter()
            stream = await api.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            first = None
            async for event in stream:
                if first is None and event.choices and event.choices[0].delta.content:
                    first = time.perf_counter() - began
                if event.usage is not None:
                    prompt_tokens += event.usage.prompt_tokens
                    details = event.usage.prompt_tokens_details
                    cached_tokens += details.cached_tokens if details and details.cached_tokens else 0
            first_tokens.append(first if first is not None else time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    seconds = time.perf_counter() - began
    await api.close()
    first_tokens.sort()
    return {
        "ttft_p50_ms": 1000 * statistics.median(first_tokens),
        "ttft_p90_ms": 1000 * first_tokens[int(0.9 * (len(first_tokens) - 1))],
        "cached_share": cached_tokens / max(prompt_tokens, 1),
        "seconds": seconds,
    }


def summary(rounds: list[dict]) -> str:
    parts = []
    for key, fmt in (
        ("ttft_p50_ms", "{:.0f}"),
        ("ttft_p90_ms", "{:.0f}"),
        ("cached_share", "{:.2f}"),
        ("seconds", "{:.1f}"),
    ):
        values = [r[key] for r in rounds]
        median = fmt.format(statistics.median(values))
        parts.append(f"{median} ({fmt.format(min(values))}-{fmt.format(max(values))})")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--build-dir", type=Path, default=Path("build/fleet"), help="a build with --prefix-cache")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="requests per round and router")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=4, help="shared system prompts per round and router")
    parser.add_argument("--prefix-words", type=int, default=400, help="words of each system prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--logs", type=Path, help="the processes' logs (default: BUILD_DIR/bench-fleet)")
    args = parser.parse_args(argv)
    fleet = Fleet(args.build_dir, args.logs or args.build_dir / "bench-fleet", router_mode="kv")
    round_robin_port = free_port()
    command = [*fleet.frontend.command]
    command[command.index("--http-port") + 1] = str(round_robin_port)
    command[command.index("--router-mode") + 1] = "round-robin"
    round_robin = Process(command, fleet.env, fleet.logs / "frontend-round-robin.log")
    urls = {"kv": fleet.url, "round-robin": f"http://127.0.0.1:{round_robin_port}"}
    results: dict[str, list[dict]] = {"kv": [], "round-robin": []}
    rng = random.Random(0)
    try:
        print(f"Starting two frontends (kv, round-robin) and two workers (logs: {fleet.logs}) ...", flush=True)
        fleet.start(workers=2)
        round_robin.start()
        round_robin.wait_for("Starting HTTP", timeout=60)
        for mode in urls:  # a warm-up: each frontend's router meets the workers (and starts hearing their events)
            asyncio.run(load(urls[mode], fleet.model, [system_prompt(rng, 20)], 4, 2, 2))
        for round_ in range(args.rounds):
            for mode in list(urls) if round_ % 2 == 0 else list(urls)[::-1]:
                prefixes = [system_prompt(rng, args.prefix_words) for _ in range(args.prefixes)]
                result = asyncio.run(
                    load(urls[mode], fleet.model, prefixes, args.requests, args.concurrency, args.max_tokens)
                )
                results[mode].append(result)
                print(f"round {round_ + 1} {mode}: {result}", flush=True)
    finally:
        round_robin.stop()
        fleet.stop()
    print(
        f"\n{args.requests} requests a round, {args.concurrency} at a time, {args.prefixes} shared prefixes of "
        f"{args.prefix_words} words, {args.max_tokens} new tokens; medians of {args.rounds} rounds (min-max)"
    )
    print("| router | first token p50 ms | first token p90 ms | prompt tokens from cache | load s |")
    print("|---|---|---|---|---|")
    for mode, rounds in results.items():
        print(f"| {mode} | " + summary(rounds) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
