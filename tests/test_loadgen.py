"""The load generator's targets (tritonllm/loadgen.py) against the real server, and make bench's first-text
baseline (tritonllm/bench.py): what the benchmarks' figures are computed from."""

import asyncio

import pytest

from tritonllm.bench import PlainGenerate
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
