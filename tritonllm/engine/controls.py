"""Embedding bias, penalties and log probabilities, per request, as argument groups (tritonllm/engine/sampling.py).

Penalties need what a request generated, and the embedding bias a dense row over the vocabulary: both live on
the device, in a row ("slot") per request that uses them (`RequestSlots`). The host fills a slot when it first
meets its request in a step (outside any captured graph), and the step itself counts the input token into it
when that token is a generated one: whether it is, the host knows from the request's position alone, so the
counts also work under asynchronous batching, where the host prepares a step before its input token exists.

Log probabilities are of the model's own distribution: the first group sees the raw float32 logits, the last
stage the scores the manager takes the argmax of (it runs greedy; sampling rows are one-hot by then). They go
to the host beside the step's tokens (`attach_log_probs`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from typing import ClassVar

import torch

from tritonllm.engine.api import TokenLogProbs
from tritonllm.engine.penalties import penalise
from tritonllm.engine.sampling import ArgumentGroup, generated_count, prompt_length
from tritonllm.protocol import MAX_TOP_LOG_PROBS

log = logging.getLogger(__name__)

NO_SLOT = -1


def float_bits(values: list[float]) -> torch.Tensor:
    """float32 values as the int32 bit patterns the argument rows carry."""
    return torch.tensor(values, dtype=torch.float32).view(torch.int32)


class RequestSlots:
    """Device rows of per-request state: counts of the generated tokens, a mask of the prompt's, the embedding
    bias. Two more rows serve the step's rows without a slot: `scratch` takes the counts they would add, `zero`
    (never written) is what they read, which leaves their scores as they are.

    Slots are taken and filled on the generation thread; any thread releases one (`release`), and the generation
    thread frees it at a later step that no longer holds its request. Device work is queued on the manager's
    compute stream, after the step in flight, which may still count a token into a slot being freed.
    """

    def __init__(self, vocab_size: int, capacity: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.capacity = max(1, capacity)
        self.device = torch.device(device)
        self.stream = None  # the manager's compute stream, once it has one
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._released: list[str] = []
        self._releasing: set[str] = set()
        self._lock = threading.Lock()
        self.counts: torch.Tensor | None = None  # float32 [capacity + 2, vocab]
        self.prompt: torch.Tensor | None = None  # bool [capacity + 2, vocab]
        self.bias: torch.Tensor | None = None  # float32 [capacity + 2, vocab]

    @property
    def scratch(self) -> int:
        return self.capacity

    @property
    def zero(self) -> int:
        return self.capacity + 1

    def __len__(self) -> int:
        return len(self._slots)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _allocate(self, capacity: int) -> None:
        """Tensors for `capacity` slots, with the slots held so far copied over."""
        rows = capacity + 2
        counts = torch.zeros(rows, self.vocab_size, dtype=torch.float32, device=self.device)
        prompt = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
        bias = torch.zeros(rows, self.vocab_size, dtype=torch.float32, device=self.device)
        held = 0
        if self.counts is not None:
            held = self.capacity  # every slot is taken (the old scratch and zero rows are not carried)
            counts[:held], prompt[:held], bias[:held] = self.counts[:held], self.prompt[:held], self.bias[:held]
        self._free.extend(range(capacity - 1, held - 1, -1))  # popped lowest first
        self.counts, self.prompt, self.bias, self.capacity = counts, prompt, bias, capacity

    def release(self, request_id: str) -> None:
        """The request has finished (any thread)."""
        with self._lock:
            self._released.append(request_id)

    def begin_step(self, requests: list) -> None:
        """Frees the slots of released requests that this step does not hold (generation thread)."""
        if self._released:
            with self._lock:
                self._releasing.update(self._released)
                self._released.clear()
        if self._releasing:
            in_step = {future.state.request_id for future in requests}
            for request_id in [r for r in self._releasing if r not in in_step]:
                self._releasing.discard(request_id)
                slot = self._slots.pop(request_id, None)
                if slot is not None:
                    self._free.append(slot)

    def slot(self, state) -> int:
        """The request's slot, taken and filled the first time (generation thread)."""
        slot = self._slots.get(state.request_id)
        if slot is not None:
            return slot
        with self._on_stream():
            if self.counts is None:
                self._allocate(self.capacity)
            elif not self._free:
                # Requests that decode in turn may outnumber a batch; graphs keyed by the capacity are recaptured.
                self._allocate(2 * self.capacity)
            slot = self._free.pop()
            self._fill(slot, state)
        self._slots[state.request_id] = slot
        return slot

    def _fill(self, slot: int, state) -> None:
        kwargs = state.logit_processor_kwargs
        self.counts[slot].zero_()
        self.prompt[slot].zero_()
        self.bias[slot].zero_()
        prompt = state.initial_tokens[: prompt_length(state)]
        if prompt and ("repetition_penalty" in kwargs or kwargs.get("count_prompt")):
            ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
            if "repetition_penalty" in kwargs:
                self.prompt[slot, ids] = True
            if kwargs.get("count_prompt"):
                self.counts[slot] += torch.bincount(ids, minlength=self.vocab_size)
        if bias := kwargs.get("embedding_bias"):
            ids, values = zip(*bias, strict=True)
            self.bias[slot].index_put_(
                (torch.tensor(ids, dtype=torch.long, device=self.device),),
                torch.tensor(values, dtype=torch.float32, device=self.device),
                accumulate=True,  # a token listed twice gets both values, as a dense bias tensor would sum them
            )

    def key(self) -> int:
        return self.capacity


class EmbeddingBias(ArgumentGroup):
    """Adds each request's embedding bias (TensorRT-LLM's `embedding_bias`, given sparse) to its logits."""

    kwargs: ClassVar[dict[str, type]] = {"embedding_bias": tuple}
    defaults = torch.tensor([[NO_SLOT]], dtype=torch.int32)
    clears_other_rows = True

    def __init__(self, slots: RequestSlots) -> None:
        self.slots = slots

    def prepare(self, requests: list) -> torch.Tensor | None:
        self.slots.begin_step(requests)
        columns = [
            (column, self.slots.slot(future.state))
            for column, future in enumerate(requests)
            if "embedding_bias" in future.state.logit_processor_kwargs
        ]
        if not columns:
            return None
        args = torch.full((1, len(requests)), NO_SLOT, dtype=torch.int32)
        for column, slot in columns:
            args[0, column] = slot
        return args

    def apply(self, scores: torch.Tensor, args: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        slot = args[0]
        return scores + self.slots.bias.index_select(0, torch.where(slot >= 0, slot, self.slots.zero))

    def key(self) -> object:
        return self.active and ("bias", self.slots.key())


class PenaltyGroup(ArgumentGroup):
    """Repetition (transformers' RepetitionPenaltyLogitsProcessor over the prompt and the generated tokens),
    presence and frequency (logit -= presence * [count > 0] + frequency * count over the generated tokens, and with
    count_prompt the prompt's: tritonllm.engine.api.Penalties) penalties. Rows: slot, whether the input token is a
    generated one (then it is counted first), and the three penalties' float32 bits. A step computes the
    repetition penalty only when a request in it has one, and likewise presence and frequency: each is a few
    passes over the step's scores."""

    kwargs: ClassVar[dict[str, type]] = {
        "repetition_penalty": float,
        "presence_penalty": float,
        "frequency_penalty": float,
        "count_prompt": bool,  # presence and frequency count the prompt's tokens too (counted when the slot is filled)
    }
    defaults = torch.tensor([[NO_SLOT], [0], *float_bits([[1.0], [0.0], [0.0]]).tolist()], dtype=torch.int32)
    clears_other_rows = True  # a stale row would count its input token again

    def __init__(self, slots: RequestSlots) -> None:
        self.slots = slots
        self._repetition = self._additive = False  # which parts the step prepared last computes

    def prepare(self, requests: list) -> torch.Tensor | None:
        self.slots.begin_step(requests)
        columns = []
        for column, future in enumerate(requests):
            kwargs = future.state.logit_processor_kwargs
            if "repetition_penalty" in kwargs or "presence_penalty" in kwargs or "frequency_penalty" in kwargs:
                state = future.state
                columns.append(
                    (
                        column,
                        self.slots.slot(state),
                        int(generated_count(state) > 0),  # the input token is the latest generated one
                        kwargs.get("repetition_penalty", 1.0),
                        kwargs.get("presence_penalty", 0.0),
                        kwargs.get("frequency_penalty", 0.0),
                    )
                )
        if not columns:
            return None
        args = self.defaults.repeat(1, len(requests))
        index, slots, counted, repetition, presence, frequency = zip(*columns, strict=True)
        self._repetition = any(r != 1.0 for r in repetition)
        self._additive = any(presence) or any(frequency)
        index = torch.tensor(index)
        args[0, index] = torch.tensor(slots, dtype=torch.int32)
        args[1, index] = torch.tensor(counted, dtype=torch.int32)
        args[2:, index] = float_bits([repetition, presence, frequency])
        return args

    def apply(self, scores: torch.Tensor, args: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        slot, counted = args[0], args[1]
        slots, counts = self.slots, self.slots.counts
        has_slot = slot >= 0
        # A flat scatter-add: atomic adds of fixed shape, which CUDA graphs capture.
        written = torch.where(has_slot & (counted > 0), slot, slots.scratch).long()
        flat = written * counts.size(1) + input_ids.long()
        counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype))
        # Rows without penalties read the zero row and neutral penalties: their scores come out unchanged.
        rows = torch.where(has_slot, slot, slots.zero)
        count = counts.index_select(0, rows)
        repetition = repeated = presence = frequency = None
        if self._repetition:
            repetition = args[2].view(torch.float32).unsqueeze(-1)
            repeated = (count > 0) | slots.prompt.index_select(0, rows)
        if self._additive:
            presence, frequency = (row.view(torch.float32).unsqueeze(-1) for row in args[3:])
        return penalise(scores, count, repeated, repetition, presence, frequency, torch)

    def key(self) -> object:
        return self.active and ("penalties", self._repetition, self._additive, self.slots.key())


class LogProbs(ArgumentGroup):
    """The log probability of each row's chosen token and of its MAX_TOP_LOG_PROBS most likely tokens, under the
    model's own distribution (log_softmax of the raw logits), into buffers the host reads after the step.

    It must come first: `apply` keeps the log_softmax of the scores it is given, `finish` takes the chosen token
    as the argmax of the final scores, the token the manager picks. The row carries the top count asked for
    (-1: none); the device computes the same top count for every row, so a step's shape does not depend on it.
    """

    kwargs: ClassVar[dict[str, type]] = {"log_probs": int}
    defaults = torch.tensor([[-1]], dtype=torch.int32)

    def __init__(self, max_rows: int, device: torch.device | str) -> None:
        self.max_rows = max_rows
        width = 1 + MAX_TOP_LOG_PROBS
        self.token_ids = torch.zeros(max_rows, width, dtype=torch.long, device=device)
        self.values = torch.zeros(max_rows, width, dtype=torch.float32, device=device)
        self._log_probs: torch.Tensor | None = None
        self._top = False
        self._asked: list[tuple[int, int]] = []  # (row, top count) of the step prepared last

    def prepare(self, requests: list) -> torch.Tensor | None:
        self._asked = [
            (column, future.state.logit_processor_kwargs["log_probs"])
            for column, future in enumerate(requests)
            if "log_probs" in future.state.logit_processor_kwargs
        ]
        if not self._asked:
            return None
        self._top = any(k > 0 for _, k in self._asked)
        args = torch.full((1, len(requests)), -1, dtype=torch.int32)
        for column, k in self._asked:
            args[0, column] = k
        return args

    def apply(self, scores: torch.Tensor, args: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        self._log_probs = scores.log_softmax(dim=-1)
        return scores

    def finish(self, scores: torch.Tensor) -> None:
        rows = scores.size(0)
        if rows > self.max_rows:
            raise RuntimeError(f"a step of {rows} logit rows, more than the {self.max_rows} log probabilities hold")
        log_probs, self._log_probs = self._log_probs, None
        chosen = scores.argmax(dim=-1, keepdim=True)
        self.token_ids[:rows, :1].copy_(chosen)
        self.values[:rows, :1].copy_(log_probs.gather(1, chosen))
        if self._top:
            values, ids = log_probs.topk(MAX_TOP_LOG_PROBS, dim=-1)
            self.token_ids[:rows, 1:].copy_(ids)
            self.values[:rows, 1:].copy_(values)

    def key(self) -> object:
        return self.active and ("log_probs", self._top)

    def collect(self, new_tokens: list[int]) -> list[TokenLogProbs | None] | None:
        """The prepared step's log probabilities, one per logit row (None where not asked), once its tokens are on
        the host; None when the step asked for none."""
        asked, self._asked = self._asked, []
        if not asked or not self.active:
            return None
        last = max(column for column, _ in asked) + 1
        token_ids = self.token_ids[:last].tolist()
        values = self.values[:last].tolist()
        out: list[TokenLogProbs | None] = [None] * len(new_tokens)
        for column, k in asked:
            chosen = values[column][0]
            if token_ids[column][0] != new_tokens[column]:  # a bug, not a request's fault: say so, stop nothing
                log.error("log probabilities of token %d, the step chose %d", token_ids[column][0], new_tokens[column])
                chosen = math.nan
            top = tuple(zip(token_ids[column][1 : 1 + k], values[column][1 : 1 + k], strict=True))
            out[column] = TokenLogProbs(chosen, top)
        return out


def attach_log_probs(inputs_and_outputs, log_probs: LogProbs) -> None:
    """Makes the manager's step update hand each token's TokenLogProbs to its request (which keeps them in its
    output's `logprobs`, aligned with its generated tokens). Synchronous batching only: the host reads the
    buffers of the step it prepared last."""
    original = inputs_and_outputs.prepare_batch_update
    if getattr(original, "_with_log_probs", False):
        return

    def prepare_batch_update():
        requests, new_tokens, logprobs = original()
        collected = log_probs.collect(new_tokens)
        return requests, new_tokens, collected if collected is not None else logprobs

    prepare_batch_update._with_log_probs = True  # type: ignore[attr-defined]
    inputs_and_outputs.prepare_batch_update = prepare_batch_update
