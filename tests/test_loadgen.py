"""The load generator's targets (tritonllm/loadgen.py) against the real server, and make bench's first-text
baseline (tritonllm/bench.py): what the benchmarks' figures are computed from."""

import asyncio

import pytest

from tritonllm.bench import EngineClock, PlainGenerate
from tritonllm.loadgen import Targets, load_prompts

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
