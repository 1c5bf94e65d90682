"""The llama.cpp engine: a GGUF model on the CPU through libllama (llama-cpp-python's low-level API).

One thread runs the steps, as llama.cpp's own server does: each step is one `llama_decode` over a batch that holds
the next token of every generating request and, in the tokens left of the step's budget, chunks of the prompts of
requests that joined (in-flight batching, one sequence id per request in a KV cache all requests share). A request
joins when a sequence id is free and the cache has room for its prompt and its new tokens, so no step fails for
want of cache. With the prefix cache on, a finished request's cells stay in the cache under its sequence id, as
llama.cpp's server keeps a slot's: a new prompt that begins with the same tokens gets the cells of the longest such
prefix shared into its own sequence and computes only the rest; kept cells give way, oldest first, to a request that
needs their room or their id. llama.cpp computes the step's logits; the host picks each request's token: the argmax
of its row, or, for a request with generation controls, its row processed alone in numpy
(tritonllm/engine/row_controls.py; torch only for a grammar's mask). Streaming, stop words, end id,
cancellation and finish reasons are the portable engine's (tritonllm/engine/portable.py).

LoRA adapters (GGUF files, tritonllm/engine/lora_gguf.py) are loaded at start, or while serving between two steps
(tritonllm/engine/llamacpp_lora.py). llama.cpp applies adapters to a whole context, not to a sequence, so a step is
one `llama_decode` per adapter its requests use, the base model's included, each with that adapter set: requests of
different adapters generate together, a decode each (docs/lora.md measures what that costs). Kept cells are shared
only with a prompt of the same adapter: they were computed with it.

`llama_decode` runs without the interpreter lock (ctypes releases it), so the engine model's sender thread sends
responses while a step computes.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tritonllm.engine.adapters import BASE, Adapter, AdapterTable
from tritonllm.engine.api import (
    LLAMA_MAX_SEQUENCES,
    BlockingGenerate,
    Emission,
    EngineConfig,
    GenerationRequest,
    SubmitRules,
    TokenLogProbs,
)
from tritonllm.engine.checks import check_submit
from tritonllm.engine.cpu_threads import start_yielding
from tritonllm.engine.kv_events import PrefixBlocks, ZmqPublisher
from tritonllm.engine.lifecycle import Lifecycle
from tritonllm.engine.llamacpp_lora import LlamaLoras
from tritonllm.engine.row_controls import RowControls
from tritonllm.errors import EngineFailure, InputError, TritonLLMError
from tritonllm.protocol import FINISH_CANCELLED, FINISH_ERROR, KV_EVENT_BLOCK_TOKENS

if TYPE_CHECKING:
    from tritonllm.engine.guided import Follower, Guides  # torch and transformers: at the first guided request only

log = logging.getLogger(__name__)

# ggml_log_level (ggml.h): WARN 3, ERROR 4; CONT 5 continues the previous line.
_LOG_WARN, _LOG_ERROR, _LOG_CONT = 3, 4, 5


@dataclass(eq=False)
class _Sequence(Lifecycle):
    request_id: str
    controls: RowControls | None  # for a request that uses any
    pending: list[int]  # tokens to feed: the prompt, then each generated token
    reserved: int  # KV cache cells held for it: its prompt and its new tokens
    position: int = 0  # tokens in the KV cache
    seq_id: int = -1  # llama.cpp's sequence id, once in the batch
    adapter: str = BASE  # the LoRA adapter its tokens are computed with
    follower: Follower | None = None  # its grammar matcher, for a guided request


class _Batch:
    """A llama_batch over numpy arrays the engine fills with vectorised writes (one sequence id per token)."""

    def __init__(self, llama, capacity: int, max_sequences: int) -> None:
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        self.seq_values = np.arange(max_sequences, dtype=np.int32)
        self.seq_address = self.seq_values.ctypes.data + self.seq_values.itemsize * np.arange(
            max_sequences, dtype=np.uint64
        )
        self.seq_id = np.zeros(capacity, np.uint64)  # pointers into seq_values
        batch = self.struct = llama.llama_batch()
        batch.token = self.token.ctypes.data_as(ctypes.POINTER(llama.llama_token))
        batch.embd = None
        batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(llama.llama_pos))
        batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = ctypes.cast(self.seq_id.ctypes.data, ctypes.POINTER(ctypes.POINTER(llama.llama_seq_id)))
        batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.size = 0

    def add(self, seq_id: int, tokens: list[int], start: int, wants_logits: bool) -> None:
        n, end = self.size, self.size + len(tokens)
        self.token[n:end] = tokens
        self.pos[n:end] = np.arange(start, start + len(tokens))
        self.seq_id[n:end] = self.seq_address[seq_id]
        self.logits[n:end] = 0
        self.logits[end - 1] = wants_logits
        self.size = self.struct.n_tokens = end


def greedy_token(scores: np.ndarray, best: int, request: GenerationRequest, generated: list[int]) -> int:
    """`best`, the argmax of `scores`, unless it is the end id before min_tokens: then the next best."""
    if best != request.end_id or len(generated) >= request.penalties.min_tokens:
        return best
    scores = scores.copy()
    scores[best] = -np.inf
    return int(scores.argmax())


class LlamaCppEngine(BlockingGenerate):
    """One model, one llama.cpp context, one thread that steps every request in flight."""

    def __init__(self, config: EngineConfig) -> None:
        import llama_cpp as llama

        self.config = config
        self._llama = llama
        route_llama_log(llama)
        llama.llama_backend_init()
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = llama.llama_model_load_from_file(config.gguf_file.encode(), model_params)
        if not self._model:
            raise EngineFailure(f"llama.cpp could not load {config.gguf_file}")
        threads = len(os.sched_getaffinity(0))
        params = llama.llama_context_default_params()
        params.n_ctx = config.kv_cache_tokens
        params.n_batch = params.n_ubatch = config.max_batch_tokens
        # Kept cells are shared into a new sequence from position 0: not for a recurrent state or a sliding window.
        self._keeps = bool(config.prefix_cache) and not (
            llama.llama_model_is_recurrent(self._model)
            or llama.llama_model_is_hybrid(self._model)
            or llama.llama_model_n_swa(self._model)
        )
        if config.prefix_cache and not self._keeps:
            log.warning("--prefix-cache is off for this model: its cache is recurrent or a sliding window")
        # As many ids again for kept cells, so a full batch does not push them all out (an id costs a bit per cell).
        sequences = min(2 * config.max_batch_size, LLAMA_MAX_SEQUENCES) if self._keeps else config.max_batch_size
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # one cache all sequences share, not n_ctx / n_seq_max each
        params.no_perf = True
        self._ctx = llama.llama_init_from_model(self._model, params)
        if not self._ctx:
            llama.llama_model_free(self._model)
            raise EngineFailure(f"llama.cpp could not make a context of {config.kv_cache_tokens} tokens")
        self._memory = llama.llama_get_memory(self._ctx)
        self.vocab_size = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self._model))
        self.submit_rules = SubmitRules(self.vocab_size)
        self.cache_tokens = llama.llama_n_ctx(self._ctx)
        description = ctypes.create_string_buffer(128)
        llama.llama_model_desc(self._model, description, len(description))
        self.description = f"{description.value.decode(errors='replace')}, {threads} threads"
        self._batch = _Batch(llama, config.max_batch_tokens, sequences)
        self._guides: Guides | None = None  # at the first guided request
        self._guides_made = threading.Lock()  # the first guided requests come on several threads: one makes it
        self._lock = threading.RLock()  # emit callbacks run under it and may ask running() or cancel()
        self._ids = itertools.count()
        self._sequences: dict[str, _Sequence] = {}  # submitted and not finished
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # in the batch, in the order they joined (the loop's alone)
        self._free_ids = list(range(sequences - 1, -1, -1))
        self._reserved = 0
        self._kept: dict[int, np.ndarray] = {}  # the prefix cache: sequence id -> its tokens' ids, oldest first
        self._kept_adapter: dict[int, str] = {}  # the adapter each kept sequence's cells were computed with
        self._kept_cells = 0
        self._blocks: PrefixBlocks | None = None  # the prefix cache as KV events, for a router
        self._events: ZmqPublisher | None = None
        if self._keeps and config.kv_events:
            self._events = ZmqPublisher(config.kv_events)
            self._blocks = PrefixBlocks(KV_EVENT_BLOCK_TOKENS, self._events)
        elif config.kv_events:
            log.warning("no KV events are published: the prefix cache is off (build with --prefix-cache)")
        self._work = threading.Event()
        self._stopping = threading.Event()
        self._steps = 0  # finished, for the health probe
        self._stopped: str | None = None  # why the engine takes no more requests (_fail_all)
        self._loras = LlamaLoras(llama, self._model, self._ctx, self._lock)
        for adapter in config.lora_adapters:
            self._loras.load_now(Adapter(**adapter))
        self._loop_thread = threading.Thread(target=self._loop, name="llamacpp-engine", daemon=True)
        # The step thread and llama.cpp's CPU threads, which it starts, yield the cores to the stream's other steps.
        start_yielding(self._loop_thread.start, config.cpu_niceness)

    # ------------------------------------------------------------------ requests

    def submit(self, request: GenerationRequest, emit: Callable[[Emission], None]) -> str:
        """Queue a request; `emit` is called from the step thread as tokens arrive. Raises InputError, naming the
        input, for controls out of range or a guide that does not compile."""
        check_submit(request, self.submit_rules)
        request_id = f"l{next(self._ids)}"
        reserved = len(request.input_ids) + request.max_new_tokens  # what the admission counts: never more
        if reserved > self.config.max_seq_len:
            raise InputError(
                "request_output_len",
                f"{len(request.input_ids)} input tokens and {request.max_new_tokens} new ones are more than the "
                f"maximum sequence length of {self.config.max_seq_len}",
            )
        if reserved > self.cache_tokens:
            raise EngineFailure(f"a request of {reserved} tokens does not fit the KV cache of {self.cache_tokens}")
        controls = self._controls(request, request_id)
        sequence = _Sequence(request_id, controls, list(request.input_ids), reserved, request=request, emit=emit)
        sequence.adapter = request.adapter
        if request.guide is not None:
            sequence.follower = self._guides.follower(request_id)
        with self._lock:  # under the lock _fail_all holds: a request is refused here or finished there, never lost
            if self._stopped is not None:
                if request.guide is not None:  # its matcher, started in _controls, follows nothing
                    self._guides.release(request_id)
                raise EngineFailure(f"{self._stopped} (see the server log)")
            if request.adapter != BASE and request.adapter not in self._loras.table.by_name:  # unloaded meanwhile
                if request.guide is not None:
                    self._guides.release(request_id)
                raise InputError("lora_name", f"no adapter named `{request.adapter}` is loaded")
            self._sequences[request_id] = sequence
            self._waiting.append(sequence)
        self._work.set()
        return request_id

    def _controls(self, request: GenerationRequest, request_id: str):
        if not request.uses_controls:
            return None
        follower = None
        if request.guide is not None:
            guides = self._guides_ready()
            compiled = guides.compile(request.guide)
            guides.start(request_id, compiled, request.end_id, request.penalties.min_tokens)
            follower = guides.follower(request_id)
        return RowControls(request, self.vocab_size, follower, request_id)

    def _guides_ready(self) -> Guides:
        from tritonllm.engine.guided import Guides  # imported outside the lock: transformers takes seconds

        with self._guides_made:
            if self._guides is None:
                self._guides = Guides(self.config.model_dir, self.vocab_size)
            return self._guides

    def cancel(self, request_id: str) -> None:
        """Stop a request; it gets a final "cancelled" emission, and the step loop frees its place."""
        with self._lock:
            sequence = self._sequences.get(request_id)
            if sequence is not None:
                self._finish(sequence, FINISH_CANCELLED)

    def running(self) -> int:
        with self._lock:
            return len(self._sequences)

    def in_batch(self) -> int:
        return len(self._running)

    def alive(self) -> bool:
        return self._loop_thread.is_alive()

    def steps(self) -> int:
        return self._steps

    def shutdown(self) -> None:
        self._stopping.set()
        self._work.set()
        self._loop_thread.join(timeout=30)
        self._fail_all("the engine is shutting down")
        if not self._loop_thread.is_alive():  # a step still running would use them
            self._llama.llama_free(self._ctx)
            self._llama.llama_model_free(self._model)
        if self._events is not None:
            self._events.close()

    # ------------------------------------------------------------------ adapters

    @property
    def adapters(self) -> AdapterTable:
        return self._loras.table

    def add_adapter(self, adapter: Adapter, timeout: float) -> None:
        """Loads a GGUF LoRA while serving, between two steps; returns once requests may name it."""
        self._change_adapters(lambda: self._loras.load(adapter), timeout)

    def remove_adapter(self, name: str, timeout: float) -> None:
        """Refuses new requests for `name` at once; returns once the requests using it finished and it is freed."""
        self._change_adapters(lambda: self._loras.unload(name), timeout)

    def _change_adapters(self, ask: Callable[[], Future], timeout: float) -> None:
        """Asks the step thread for a change (under the lock, so never after _fail_all) and waits until it is made."""
        with self._lock:
            if self._stopped is not None:
                raise EngineFailure(f"{self._stopped} (see the server log)")
            done = ask()
        self._work.set()
        done.result(timeout)

    def _adapters_in_use(self) -> set[str]:
        return {s.adapter for s in self._sequences.values()} | {s.adapter for s in self._running}

    def _forget_adapter(self, name: str) -> None:
        for seq_id in [k for k, adapter in self._kept_adapter.items() if adapter == name]:
            self._forget(seq_id)

    # ------------------------------------------------------------------ the step loop

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._admit()
                if self._loras.pending():
                    self._loras.sweep(self._adapters_in_use, self._forget_adapter)
                if not self._running:
                    self._work.wait(0.1)
                    self._work.clear()
                    continue
                self._step()
                self._steps += 1
        except Exception as exc:  # a bug or a failed decode: every request learns it, none waits forever
            log.exception("the llama.cpp engine's step loop failed")
            self._fail_all(f"the engine's step loop failed: {exc}")

    def _admit(self) -> None:
        """Frees the places of finished requests, then lets waiting ones join while ids and cache room last."""
        for sequence in [s for s in self._running if s.done]:
            self._running.remove(sequence)
            self._reserved -= sequence.reserved
            if self._keeps and sequence.position:
                cells = np.array((sequence.request.input_ids + sequence.tokens)[: sequence.position], np.int32)
                self._kept[sequence.seq_id] = cells
                self._kept_adapter[sequence.seq_id] = sequence.adapter
                self._kept_cells += len(cells)
                if self._blocks is not None:
                    self._blocks.kept(cells, sequence.adapter)
            else:
                self._llama.llama_memory_seq_rm(self._memory, sequence.seq_id, -1, -1)
                self._free_ids.append(sequence.seq_id)
        with self._lock:
            while self._waiting and len(self._running) < self.config.max_batch_size:
                head = self._waiting[0]
                if head.done:
                    self._waiting.popleft()
                    continue
                if not self._place(head):
                    break  # in order: a long request is not overtaken for ever by short ones
                self._waiting.popleft()
                self._running.append(head)
                head.scheduled = time.perf_counter()

    def _place(self, head: _Sequence) -> bool:
        """Gives `head` a sequence id and its cache room, and the kept cells that share the longest prefix with its
        prompt (shared, not copied: llama.cpp's cells carry a set of sequence ids). When room or an id is short,
        `head` takes that prefix's sequence over if that is enough, else other kept cells go, oldest first."""
        room = self.cache_tokens - self._reserved - head.reserved  # what kept cells may hold once it runs
        if room < 0:
            return False  # running requests hold the room: it waits, and no kept cells go for nothing
        source, reused = self._longest_prefix(head.pending, head.adapter)
        prefix = self._kept[source] if source is not None else None

        def shares() -> bool:
            return bool(self._free_ids) and self._kept_cells <= room

        if not shares() and not (prefix is not None and self._kept_cells - len(prefix) <= room):
            for victim in [k for k in self._kept if k != source]:
                self._forget(victim)
                if shares():
                    break
        if shares():
            head.seq_id = self._free_ids.pop()
            if source is not None:
                self._llama.llama_memory_seq_cp(self._memory, source, head.seq_id, 0, reused)
                self._kept[source] = self._kept.pop(source)  # the most recently used now
        elif prefix is not None:  # room, or an id, only without the prefix's own sequence: `head` takes it over
            self._drop(source)
            self._llama.llama_memory_seq_rm(self._memory, source, reused, -1)
            head.seq_id = source
        else:  # not met: with no prefix, dropping every kept sequence frees ids (fewer run than there are ids)
            return False
        head.position = head.cached = reused
        del head.pending[:reused]
        self._reserved += head.reserved
        return True

    def _longest_prefix(self, prompt: list[int], adapter: str) -> tuple[int | None, int]:
        """The kept sequence of `adapter` that begins with the most of `prompt`'s tokens, and how many it can give:
        all but the prompt's last, which is computed for its logits. (None, 0) when none begins with its first token."""
        best, length = None, 0
        if not self._kept:  # the cache is off, or empty: no array of the prompt for nothing
            return best, length
        tokens = np.array(prompt[:-1], np.int32)
        for seq_id, cells in self._kept.items():
            if self._kept_adapter[seq_id] != adapter:
                continue
            n = min(len(cells), len(tokens))
            differ = np.flatnonzero(cells[:n] != tokens[:n])
            common = int(differ[0]) if differ.size else n
            if common > length:
                best, length = seq_id, common
        return best, length

    def _forget(self, seq_id: int) -> None:
        self._llama.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        self._drop(seq_id)
        self._free_ids.append(seq_id)

    def _drop(self, seq_id: int) -> None:
        """`seq_id` is no longer a kept sequence (its cells go, or a running request takes them over)."""
        cells, adapter = self._kept.pop(seq_id), self._kept_adapter.pop(seq_id)
        self._kept_cells -= len(cells)
        if self._blocks is not None:
            self._blocks.dropped(cells, adapter)

    def _step(self) -> None:
        """Generating requests first, a token each; prompts take what is left of the step's budget. One decode per
        adapter in use."""
        budget = self.config.max_batch_tokens
        groups: dict[str, list[tuple[_Sequence, list[int]]]] = {}
        for sequence in sorted(self._running, key=lambda s: len(s.pending) > 1):
            if sequence.done or not budget:
                continue
            chunk = sequence.pending[:budget]
            budget -= len(chunk)
            groups.setdefault(sequence.adapter, []).append((sequence, chunk))
        # The adapter set on the context goes first, so a step of G adapters sets G - 1 of them (each set makes
        # llama.cpp reserve its compute graph again at the next decode; cheap beside the decode: docs/performance.md).
        for adapter in sorted(groups, key=lambda name: name != self._loras.active):
            self._decode(adapter, groups[adapter])

    def _decode(self, adapter: str, chunks: list[tuple[_Sequence, list[int]]]) -> None:
        """One llama_decode of the chunks of requests of one adapter, and their next tokens."""
        batch = self._batch
        batch.size = 0
        outputs: list[_Sequence] = []
        for sequence, chunk in chunks:
            last = len(chunk) == len(sequence.pending)
            batch.add(sequence.seq_id, chunk, sequence.position, last)
            sequence.position += len(chunk)
            del sequence.pending[: len(chunk)]
            if last:
                outputs.append(sequence)
        self._loras.use(adapter)
        code = self._llama.llama_decode(self._ctx, batch.struct)
        if code != 0:
            raise EngineFailure(f"llama_decode returned {code} for a step of {batch.size} tokens")
        if not outputs:
            return
        logits = np.ctypeslib.as_array(self._llama.llama_get_logits(self._ctx), shape=(len(outputs), self.vocab_size))
        best = logits.argmax(axis=1)
        now = time.perf_counter()
        for row, sequence in enumerate(outputs):
            if sequence.controls is None:
                token, log_probs = greedy_token(logits[row], int(best[row]), sequence.request, sequence.tokens), None
            else:
                try:
                    token, log_probs = sequence.controls.choose(logits[row], sequence.tokens)
                except Exception as exc:  # this request's controls: it fails alone, the step goes on for the others
                    log.exception("request %s: its controls failed", sequence.request_id)
                    with self._lock:
                        if not sequence.done:
                            self._finish(sequence, FINISH_ERROR, f"internal error in the request's controls: {exc}")
                    continue
            self._advance(sequence, token, log_probs, now)

    def _advance(self, sequence: _Sequence, token: int, log_probs: TokenLogProbs | None, now: float) -> None:
        with self._lock:
            if sequence.done:  # cancelled while its step ran
                return
            if sequence.follower is not None and sequence.follower.lost is not None:  # `token` is off its grammar
                self._finish(sequence, FINISH_ERROR, sequence.follower.lost)
                return
            reason = sequence.take(token, log_probs, now)
            if reason is None:
                sequence.pending.append(token)
                sequence.emit_new()
            else:
                self._finish(sequence, reason)

    def _finish(self, sequence: _Sequence, reason: str, error: str | TritonLLMError | None = None) -> None:
        """The request's final emission (under the lock); the step loop frees its place."""
        self._sequences.pop(sequence.request_id, None)
        if self._guides is not None and sequence.request.guide is not None:
            self._guides.release(sequence.request_id)
        sequence.finish(reason, error)

    def _fail_all(self, error: str) -> None:
        """Ends every request with `error`; the engine takes no more (submit raises)."""
        with self._lock:
            self._stopped = error
            for sequence in list(self._sequences.values()):
                self._finish(sequence, FINISH_ERROR, error)
        self._loras.fail_pending(error)


def route_llama_log(llama) -> None:
    """llama.cpp's warnings and errors into this module's log; its information lines (every tensor it loads) away."""
    level = [0]

    @llama.llama_log_callback
    def forward(kind: int, text: bytes, user_data) -> None:
        if kind != _LOG_CONT:
            level[0] = kind
        if level[0] in (_LOG_WARN, _LOG_ERROR):
            with contextlib.suppress(Exception):
                log.warning("llama.cpp: %s", text.decode(errors="replace").rstrip())

    route_llama_log.callback = forward  # kept alive: llama.cpp holds the pointer
    llama.llama_log_set(forward, ctypes.c_void_p(0))
