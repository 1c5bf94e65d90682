"""Which of the batching manager's steps replay CUDA graphs.

transformers captures a graph for every step shape it meets: the padded query tokens, the KV tokens
read and the longest request, so while requests arrive and their prompts are prefilled in chunks,
steps keep meeting new shapes and pay a capture each. A graph saves the host's kernel launches
(~850 per step for a 7B model), which is what bounds a small step; a step of many query tokens keeps
the device busy far longer than its launches take, and under asynchronous batching the host launches
it while the device runs the step before. So steps above a number of query tokens run eagerly.
"""

from __future__ import annotations


def graph_steps_up_to(model_runner, inputs_and_outputs, max_q_tokens: int) -> None:
    """Steps of more than `max_q_tokens` (padded) query tokens run without a graph."""
    choose = getattr(model_runner, "_get_forward_fn", None)
    if choose is None:
        raise RuntimeError(f"transformers' step runner changed: {type(model_runner).__name__} has no _get_forward_fn")
    pairs = getattr(inputs_and_outputs, "io_pairs", None)

    def step_q_tokens() -> int:  # what the graph store keys the step by: the device buffers' sizes
        io = pairs[inputs_and_outputs.current_pair].device_io if pairs else inputs_and_outputs
        return io.num_q_tokens

    def forward_fn(use_block_table: bool):
        forward, graphed = choose(use_block_table)
        return forward, graphed and step_q_tokens() <= max_q_tokens

    model_runner._get_forward_fn = forward_fn
