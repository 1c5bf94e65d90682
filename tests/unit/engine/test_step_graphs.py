"""Only steps up to a number of query tokens replay CUDA graphs (tritonllm/engine/step_graphs.py); no GPU needed."""

from types import SimpleNamespace

import pytest
from transformers.generation.continuous_batching.model_runner import ModelRunner

from tritonllm.engine.step_graphs import graph_steps_up_to


class Runner:
    def __init__(self, graphs: bool) -> None:
        self.graphs = graphs

    def _get_forward_fn(self, use_block_table: bool):
        return ("decode" if use_block_table else "varlen"), self.graphs


def test_steps_above_the_limit_run_eagerly_the_others_as_before():
    io = SimpleNamespace(num_q_tokens=256)
    runner = Runner(graphs=True)
    graph_steps_up_to(runner, io, 256)
    assert runner._get_forward_fn(True) == ("decode", True)
    io.num_q_tokens = 272
    assert runner._get_forward_fn(False) == ("varlen", False)
    off = Runner(graphs=False)  # a path without graphs stays without
    graph_steps_up_to(off, SimpleNamespace(num_q_tokens=1), 256)
    assert off._get_forward_fn(True) == ("decode", False)


def test_under_asynchronous_batching_the_current_pair_decides():
    pairs = [SimpleNamespace(device_io=SimpleNamespace(num_q_tokens=n)) for n in (4096, 16)]
    ios = SimpleNamespace(io_pairs=pairs, current_pair=1)
    runner = Runner(graphs=True)
    graph_steps_up_to(runner, ios, 256)
    assert runner._get_forward_fn(False)[1] is True
    ios.current_pair = 0
    assert runner._get_forward_fn(False)[1] is False


def test_transformers_still_has_the_hook_and_a_changed_one_is_reported():
    assert callable(getattr(ModelRunner, "_get_forward_fn", None))
    with pytest.raises(RuntimeError, match="no _get_forward_fn"):
        graph_steps_up_to(object(), SimpleNamespace(num_q_tokens=1), 256)
