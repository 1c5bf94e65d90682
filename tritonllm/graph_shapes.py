"""Coarser CUDA-graph shapes for large steps, so served loads stop meeting new ones.

Under CUDA graphs the batching manager pads a step's query tokens to a multiple of one interval (16 here)
and captures a graph for each padded size it meets. Decode steps stay small, but a step that prefills
prompts of requests arriving at their own pace can take any size up to the step budget (4,096 tokens):
256 sizes, and each new one costs a warm-up step and a capture in the middle of a load. Served loads kept
capturing on their second run (docs/PERFORMANCE.md). Where 1/`per_doubling` of the power of two at or
below a size is larger than the interval (from 256 tokens for 16 and 8), sizes are padded to multiples
of that instead: at most 12.5 % more tokens for `per_doubling` 8, in steps large enough to be bound by
compute rather than by the weights' read, and 16 + 8 sizes per doubling (48 up to 4,096) in all.
"""

from __future__ import annotations


def query_bucket(tokens: int, interval: int, per_doubling: int) -> int:
    """`tokens` padded up to a multiple of `interval`, or of 1/`per_doubling` of the power of two below it
    when that is larger; `per_doubling` 0 keeps the plain interval."""
    step = interval
    if per_doubling > 0 and tokens > 0:
        step = max(interval, (1 << (tokens.bit_length() - 1)) // per_doubling)
    return -(-max(tokens, 1) // step) * step


def coarsen_query_padding(runner, interval: int, per_doubling: int) -> None:
    """Makes transformers' model runner pad the query tokens of its graph steps with `query_bucket`."""
    pad = runner.maybe_pad_inputs

    def maybe_pad_inputs(num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool) -> tuple[int, int]:
        num_q_tokens, max_kv_read = pad(num_q_tokens, max_kv_read, use_decode_fast_path)
        if runner.pad_inputs and not use_decode_fast_path:  # the fast path pads to powers of two already
            bucket = query_bucket(num_q_tokens, interval, per_doubling)
            num_q_tokens = min(bucket, runner.cache.max_batch_tokens)
        return num_q_tokens, max_kv_read

    runner.maybe_pad_inputs = maybe_pad_inputs
