"""Per-request sampling and bad words inside transformers' continuous batching, as tensor operations.

transformers' batching manager samples with one global switch (`do_sample`) and one global random
generator, so a request's result would depend on which other requests share its batch. The engine
runs the manager greedy (argmax) and these processors turn the row of each sampling request into a
one-hot row of the token drawn for it: temperature, top-k, top-p, then the kept distribution inverted at
a uniform number that is a counter-based hash of (request seed, position). A draw therefore depends on the
request alone, and greedy rows are untouched, so greedy output is exactly `generate(do_sample=False)`'s.

The manager keeps int32 rows of per-request arguments, prepared on the host before each step.
Everything computed from those rows is tensor operations of fixed shape, with no host
synchronisation, so the processing is captured in the manager's CUDA graphs. A step runs only the
groups (bad words, sampling) some request in it uses, and under CUDA graphs the groups a step runs are
part of its graph's key: a greedy step does not pay for sorting the vocabulary. The rows use only what
the host knows before the step's input token, which asynchronous batching is still generating when it
prepares the step: the position a step generates (the manager's offset), and for bad words the tokens
before the input token; the input token itself is compared on the device.

The other generation controls (embedding bias, penalties, log probabilities: tritonllm/engine/controls.py; guided
decoding: tritonllm/engine/guided.py) are argument groups too; `request_processors` orders them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from transformers import LogitsProcessorList
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessorList
from transformers.generation.continuous_batching.utils import CudaGraphBuffer

from tritonllm.engine.api import ends_with
from tritonllm.engine.logits import GREEDY, ban, sample
from tritonllm.engine.row_draw import MIN_TEMPERATURE, step_seed


class ArgumentGroup:
    """Per-request values on several argument rows, and the tensor function that uses them.

    `prepare` fills the rows on the host before each step; `apply` runs on the step's scores. A step
    whose rows all hold their defaults (no request uses the group) skips both the copy and `apply`.
    """

    kwargs: ClassVar[dict[str, type]]
    defaults: torch.Tensor  # int32 [rows, 1]: each row's default bit pattern
    active = False  # whether the step prepared last uses the group
    # The step's scores have a row for each request in it, and padding rows under CUDA graphs, past the rows of the
    # requests with a new token: their arguments are left from earlier steps. A group whose `apply` changes state
    # (token counts) gets its defaults there.
    clears_other_rows = False

    @property
    def rows(self) -> int:
        return self.defaults.shape[0]

    def prepare(self, requests: list) -> torch.Tensor | None:
        """int32 [rows, len(requests)] on the host; None when no request uses the group (a cheaper way to say it
        than rows of defaults)."""
        raise NotImplementedError

    def apply(self, scores: torch.Tensor, args: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """args: int32 [rows, scores.size(0)]; input_ids: each row's current input token, on the device."""
        raise NotImplementedError

    def finish(self, scores: torch.Tensor) -> None:
        """Called with the step's final scores (after every group) when the group is active."""

    def key(self) -> object:
        """What tells apart, in a CUDA graph's key, the processing this group captured; falsy when inactive."""
        return self.active


class ArgumentGroups(ContinuousBatchingLogitsProcessorList):
    """transformers' per-request processor list, with argument groups of several rows each.

    It keeps the interface the batching manager calls (defaults, preparing the argument storage,
    processing scores); the stock list gives each processor a single row and a call per step.
    """

    def __init__(self, groups: Sequence[ArgumentGroup]) -> None:
        super().__init__(LogitsProcessorList())
        self.groups = list(groups)
        self.tensors_required = sum(g.rows for g in self.groups)
        self.supported_keys = {k: v for g in self.groups for k, v in g.kwargs.items()}
        self.ignored_keys = set()
        self.do_processing = bool(self.groups)

    def _spans(self):
        start = 0
        for group in self.groups:
            yield group, slice(start, start + group.rows)
            start += group.rows

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        for group, rows in self._spans():
            int32_tensor[rows] = group.defaults.to(int32_tensor.device)

    def prepare_tensor_args(self, requests_in_batch: list, arg_storage: torch.Tensor) -> torch.Tensor:
        requests = [r for r in requests_in_batch if r.has_new_token]  # processors see new tokens only
        # A group no request of the step passes arguments to is not asked: a plain step costs one pass here.
        passed = set().union(*(r.state.logit_processor_kwargs for r in requests))
        for group, rows in self._spans():
            values = group.prepare(requests) if passed.intersection(group.kwargs) else None
            group.active = values is not None and bool(values.ne(group.defaults).any())
            if group.active:
                arg_storage[rows, : len(requests)] = values.to(arg_storage.device)
                if group.clears_other_rows:
                    arg_storage[rows, len(requests) :] = group.defaults.to(arg_storage.device)
        return arg_storage

    def graph_key(self, key: tuple) -> tuple:
        """The CUDA graph key of a step with shape `key`: the processing captured differs with the groups the
        step uses. A step that uses none keeps the manager's own key (its warm-up captures stay valid)."""
        used = tuple(group.key() for group in self.groups)
        return (key, used) if any(used) else key

    # Outside compilation (EngineConfig.compile): the groups a step runs are read from the host each step, which
    # the compiler would guard on, recompiling the whole step the first time a request samples.
    @torch.compiler.disable
    def __call__(self, input_ids, scores: torch.Tensor, logits_processor_args: torch.Tensor) -> torch.Tensor:
        for group, rows in self._spans():
            if group.active:
                scores = group.apply(scores, logits_processor_args[rows, : scores.size(0)], input_ids)
        for group in self.groups:
            if group.active:
                group.finish(scores)
        return scores


def _bits(value: float) -> int:
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))


class Sampling(ArgumentGroup):
    """Requests pass `sample=True, temperature=, top_k=, top_p=, seed=` as logit-processor kwargs."""

    kwargs: ClassVar[dict[str, type]] = {
        "sample": bool,
        "temperature": float,
        "top_k": int,
        "top_p": float,
        "seed": int,
    }
    # temperature (float32 bits), top_k, top_p (float32 bits), step seed
    defaults = torch.tensor([[_bits(1.0)], [0], [_bits(1.0)], [GREEDY]], dtype=torch.int32)

    def prepare(self, requests: list) -> torch.Tensor:
        temperature, top_k, top_p, seeds = [], [], [], []
        for future in requests:
            kwargs = future.state.logit_processor_kwargs
            if kwargs.get("sample"):
                temperature.append(max(kwargs["temperature"], MIN_TEMPERATURE))
                top_k.append(min(kwargs["top_k"], 2**31 - 1))
                top_p.append(kwargs["top_p"])
                seeds.append(step_seed(kwargs["seed"], future.state.position_offset))
            else:
                temperature.append(1.0)
                top_k.append(0)
                top_p.append(1.0)
                seeds.append(GREEDY)
        floats = torch.tensor([temperature, top_p], dtype=torch.float32).view(torch.int32)
        ints = torch.tensor([top_k, seeds], dtype=torch.int32)
        return torch.stack([floats[0], ints[0], floats[1], ints[1]])

    def apply(self, scores: torch.Tensor, args: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        temperature, top_k, top_p, seeds = args
        return sample(scores, temperature.view(torch.float32), top_k, top_p.view(torch.float32), seeds)


class BadWords(ArgumentGroup):
    """Bans, per request, the last token of each bad word whose other tokens were just generated, and the end id
    while fewer than `min_tokens` tokens are generated (a one-token bad word then).

    Two rows per word a request may give (`max_words`, and one for the end id): the token to ban and the input
    token that must precede it (-1: any). The host checks the word's earlier tokens against the tokens before the
    step's input token; the input token itself is checked on the device, because with asynchronous batching the
    host prepares a step before the previous one has produced that token.
    """

    kwargs: ClassVar[dict[str, type]] = {"bad_words": tuple, "min_tokens": int}

    def __init__(self, max_words: int) -> None:
        self.max_words = max_words + 1  # the end id's place
        self.defaults = torch.full((2 * self.max_words, 1), -1, dtype=torch.int32)

    def prepare(self, requests: list) -> torch.Tensor | None:
        args = None
        for column, future in enumerate(requests):
            kwargs = future.state.logit_processor_kwargs
            words = kwargs.get("bad_words") or ()
            if kwargs.get("min_tokens", 0) > generated_count(future.state):
                words = (*words, (future.state.eos_token_id,))  # the manager's end id: one int (portable.py)
            if words:
                # The step's input token sits at position_offset - 1; it may not have reached the host yet.
                longest = max(len(w) for w in words)
                before = tokens_before(future.state, future.state.position_offset - 1, longest - 2)
                pairs = [(w[-1], w[-2] if len(w) > 1 else -1) for w in words if ends_with(before, w[:-2])]
                if pairs:
                    if args is None:
                        args = torch.full((self.rows, len(requests)), -1, dtype=torch.int32)
                    banned, preceding = torch.tensor(pairs, dtype=torch.int32).T
                    args[: len(pairs), column] = banned
                    args[self.max_words : self.max_words + len(pairs), column] = preceding
        return args

    def apply(self, scores: torch.Tensor, args: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        banned, preceding = args[: self.max_words].T, args[self.max_words :].T
        follows = (preceding < 0) | (preceding == input_ids.view(-1, 1))
        return ban(scores, torch.where(follows, banned, -1))


def request_processors(
    max_words: int, before_bans: Sequence[ArgumentGroup] = (), before_sampling: Sequence[ArgumentGroup] = ()
) -> ArgumentGroups:
    """The engine's processors: bans first, so a sampling request draws from the tokens left to it. The groups
    `before_bans` (log probabilities, embedding bias, penalties) run ahead of them, `before_sampling` (a grammar's
    mask) right after them."""
    return ArgumentGroups([*before_bans, BadWords(max_words), *before_sampling, Sampling()])


class ProcessorKeyedGraphs(CudaGraphBuffer):
    """transformers' CUDA graph store, keyed also by the processor groups a step uses (ArgumentGroups.graph_key)."""

    def __init__(self, graphs: CudaGraphBuffer, processors: ArgumentGroups) -> None:
        super().__init__()
        self._storage, graphs._storage = graphs._storage, {}  # the graphs captured so far (warm-up) move here
        self.processors = processors

    def get_graph(self, key: tuple) -> torch.cuda.CUDAGraph | None:
        return super().get_graph(self.processors.graph_key(key))

    def set_graph(self, key: tuple, graph: torch.cuda.CUDAGraph) -> None:
        super().set_graph(self.processors.graph_key(key), graph)

    def __len__(self) -> int:
        return len(self._storage)


def key_graphs_by_processors(inputs_and_outputs, processors: ArgumentGroups) -> list[ProcessorKeyedGraphs]:
    """Swaps the graph store of each of the batching manager's step buffers (two under asynchronous batching)
    for a ProcessorKeyedGraphs, and returns them. Without it a step that samples could replay a greedy step's
    graph."""
    pairs = getattr(inputs_and_outputs, "io_pairs", None)
    holders = [pair.device_io for pair in pairs] if pairs else [inputs_and_outputs]
    for io in holders:
        if not isinstance(getattr(io, "graphs", None), CudaGraphBuffer):
            raise RuntimeError(f"transformers' step buffers changed: {type(io).__name__} has no CUDA graph store")
        io.graphs = ProcessorKeyedGraphs(io.graphs, processors)
    return [io.graphs for io in holders]


def prompt_length(state) -> int:
    """The request's own prompt length. When the manager restarts a request whose cache it had to drop, its
    `initial_tokens` become the prompt and the tokens generated so far (`_true_initial_tokens` keeps the length)."""
    return getattr(state, "_true_initial_tokens", 0) or len(state.initial_tokens)


def generated_count(state) -> int:
    """Tokens the request had generated before the step being prepared (the manager has advanced
    `position_offset` past the step's input tokens), known on the host before the step's input token is."""
    return state.position_offset - prompt_length(state)


def generated_tokens(state) -> list[int]:
    """The tokens generated so far that reached the host (a restarted request's first ones are in its prompt)."""
    true_prompt = getattr(state, "_true_initial_tokens", 0)
    if true_prompt:
        return state.initial_tokens[true_prompt:] + state.generated_tokens
    return state.generated_tokens


def tokens_before(state, end: int, count: int) -> list[int]:
    """The (up to) `count` tokens before position `end` of a request's prompt and generated tokens, read
    without joining the two lists: this runs for each request with bad words at every step."""
    if count <= 0:
        return []
    start, prompt = max(0, end - count), state.initial_tokens
    return prompt[start:end] + state.generated_tokens[max(0, start - len(prompt)) : max(0, end - len(prompt))]
