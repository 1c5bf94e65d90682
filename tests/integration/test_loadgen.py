"""The load generator's targets (benchmarks/loadgen.py) against the real server, and make bench's first-text
baseline (benchmarks/bench.py): what the benchmarks' figures are computed from."""

import asyncio
import time

import pytest

from benchmarks.bench import EngineClock, PlainGenerate, latency_pairs, serve_levels
from benchmarks.loadgen import Record, Targets, load_prompts

TOKENS = 4


@pytest.mark.parametrize(
    ("target", "streams"), [("stream", True), ("engine_stream", True), ("ensemble", False), ("engine", False)]
)
def test_each_target_counts_its_tokens(server, tokenizer, target, streams):
    async def one():
        targets = Targets(f"{server.host}:{server.grpc_port}", server.http_url, load_prompts(), TOKENS, tokenizer)
        try:
            return await getattr(targets, target)(0)
        finally:
            await targets.close()

    record = asyncio.run(one())
    assert record.error is None
    assert record.output_tokens == TOKENS
    if streams:
        assert record.start < record.first_token <= record.end
    else:
        assert record.first_token is None


def test_first_text_waits_for_a_whole_character(manifest):
    """A Chinese answer starts with a character of several byte tokens; an English one with a word."""
    prompts = load_prompts()
    chinese = next(i for i, p in enumerate(prompts) if "长城" in p)
    generate = PlainGenerate(manifest, prompts)
    assert generate.first_text_tokens(0) == 1
    assert generate.first_text_tokens(chinese) > 1


def test_engine_clock_reads_each_request_own_time_to_first_token(server, tokenizer):
    """The engine's own TTFT of a streamed request is positive and below what the client waited for it."""
    clock = EngineClock(server.metrics)

    async def one():
        targets = Targets(f"{server.host}:{server.grpc_port}", server.http_url, load_prompts(), TOKENS, tokenizer)
        try:
            return await targets.engine_stream(1)
        finally:
            await targets.close()

    waits = []
    for _ in range(2):
        record = asyncio.run(one())
        waits.append(((record.first_token - record.start) * 1000, clock.last_ms()))
    assert all(0 < own < waited for waited, own in waits), waits
    with pytest.raises(RuntimeError, match="found 0"):
        clock.last_ms(timeout=0.2)  # no request finished since


class TimedTargets:
    """Two targets whose requests take a known time each (no server): 10 tokens in 20 ms and in 40 ms."""

    async def fast(self, i: int) -> Record:
        return await self._wait(0.02)

    async def slow(self, i: int) -> Record:
        return await self._wait(0.04)

    def sender(self, name: str):
        return getattr(self, name)

    async def _wait(self, seconds: float) -> Record:
        start = time.perf_counter()
        await asyncio.sleep(seconds)
        return Record(start, time.perf_counter(), None, 10)

    async def close(self) -> None:
        pass


def test_interleaved_rounds_count_only_their_own_time():
    """A B A B: merged over the rounds' span, each rate would also count the other target's rounds, and the
    ratio of the two would be pulled toward 1 (here ~0.6 instead of 0.5)."""
    levels = asyncio.run(serve_levels(TimedTargets, [("fast", 1), ("slow", 1)] * 3, 2))
    fast, slow = levels[("fast", 1)], levels[("slow", 1)]
    assert fast.requests == slow.requests == 12
    assert 300 < fast.output_tokens_per_s <= 500  # 10 tokens / 20 ms, less the event loop's own time
    assert 0.45 < slow.output_tokens_per_s / fast.output_tokens_per_s < 0.55


class PipelineTargets(TimedTargets):
    """The ensemble 10 ms slower than the engine model alone; records the order of the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def ensemble(self, i: int) -> Record:
        self.calls.append("ensemble")
        return await self._wait(0.03)

    async def engine(self, i: int) -> Record:
        self.calls.append("engine")
        return await self._wait(0.02)


def test_latency_pairs_are_back_to_back_in_alternating_order():
    targets = PipelineTargets()
    pairs = asyncio.run(latency_pairs(lambda: targets, 4))
    assert targets.calls == ["engine", "ensemble", "ensemble", "engine"] * 2
    assert all(5 < ensemble - engine < 15 for ensemble, engine in pairs), pairs
