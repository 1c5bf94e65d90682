"""Coarser query padding for large CUDA-graph steps (tritonllm/graph_shapes.py)."""

from types import SimpleNamespace

from tritonllm.graph_shapes import coarsen_query_padding, query_bucket


def test_small_steps_keep_the_interval_and_large_ones_pad_at_most_an_eighth():
    assert [query_bucket(t, 16, 8) for t in (1, 16, 17, 255, 256)] == [16, 16, 32, 256, 256]
    assert [query_bucket(t, 16, 8) for t in (257, 300, 600, 2049, 4096)] == [288, 320, 640, 2304, 4096]
    assert all(t <= query_bucket(t, 16, 8) <= t * 9 / 8 for t in range(128, 4097))
    assert len({query_bucket(t, 16, 8) for t in range(1, 4097)}) == 48  # against 256 multiples of 16
    assert [query_bucket(t, 16, 0) for t in (1, 17, 300, 4095)] == [16, 32, 304, 4096]


def test_the_runner_pads_graph_steps_within_its_budget_and_leaves_the_rest():
    def pad(num_q_tokens, max_kv_read, use_decode_fast_path):  # transformers' own: to 16 under graphs
        return (-(-num_q_tokens // 16) * 16 if runner.pad_inputs else num_q_tokens), max_kv_read

    runner = SimpleNamespace(maybe_pad_inputs=pad, pad_inputs=True, cache=SimpleNamespace(max_batch_tokens=4000))
    coarsen_query_padding(runner, 16, 8)
    assert runner.maybe_pad_inputs(300, 512, False) == (320, 512)
    assert runner.maybe_pad_inputs(3900, 512, False) == (4000, 512)  # never past the step buffers
    assert runner.maybe_pad_inputs(300, 512, True) == (304, 512)  # the decode fast path keeps its own
    runner.pad_inputs = False  # no graphs: no padding
    assert runner.maybe_pad_inputs(300, 512, False) == (300, 512)
