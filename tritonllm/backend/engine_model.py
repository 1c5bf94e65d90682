"""Triton adapter of the portable engine: the decoupled `tensorrt_llm` model.

`execute` parses each request, hands it to the engine and returns at once; the engine's router
thread reports tokens, and an `Outbox` thread turns them into responses (merging a stream's tokens
that queued up while it was busy), so neither generation nor request intake ever waits on the
server's IPC. Like the TensorRT-LLM backend, a non-streaming
request gets one response holding all its tokens; a streaming one gets a response per new
tokens; both end with a COMPLETE_FINAL flag. A request ended early (TensorRT-LLM's `stop`
request, or a cancelled client) ends the same way, with the tokens generated until then.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonllm.backend.engine_io import RowTimes, exclude_input, pack_outputs, parse_requests, perf_outputs
from tritonllm.backend.metrics import EngineMetrics
from tritonllm.backend.outbox import Outbox
from tritonllm.backend.triton_glue import (
    ENGINE_PARAMETER_INPUTS,
    FINAL,
    error_response,
    flag,
    input_arrays,
    log_exception,
    log_info,
    model_config,
    parameters,
    requested_outputs,
    to_tensors,
)
from tritonllm.engine.api import (
    ENGINE_CONFIG_FILE,
    LLAMACPP,
    BlockingGenerate,
    Emission,
    EngineConfig,
    GenerationRequest,
)
from tritonllm.engine.process import EngineProcess
from tritonllm.engine.synthetic import SYNTHETIC_CONFIG_FILE, SyntheticConfig, SyntheticEngine
from tritonllm.errors import EngineFailure, InputError, ServerBusy
from tritonllm.text.tokenization import Limits, scalar

CANCEL_CHECK_SECONDS = 0.2  # and the period of the load gauges


@dataclass
class _Call:
    """One Triton request: one or more engine requests (one per batch row) and its response sender."""

    sender: object
    request_id: str  # the client's request id ("" when none), the key of `stop` requests
    requests: list[GenerationRequest]
    exclude_input: bool
    pad_id: int
    counts: tuple[bool, bool]  # return_num_input_tokens, return_num_output_tokens
    perf: bool  # return_perf_metrics: the KV cache block counts and the request's times (perf_outputs)
    wanted: set[str] | None  # the outputs the request asked for (triton_glue.requested_outputs)
    arrival: float = field(default_factory=time.perf_counter)  # the steady clock, as TensorRT-LLM's times
    engine_ids: list[str] = field(default_factory=list)
    submitted: dict[int, float] = field(default_factory=dict)  # per row, when handed to the engine
    times: dict[int, RowTimes] = field(default_factory=dict)  # per row, its scheduling and token times
    tokens: dict[int, list[int]] = field(default_factory=dict)  # finished rows
    log_probs: dict[int, list] = field(default_factory=dict)  # finished rows' TokenLogProbs, when asked
    cum_log_prob: float = 0.0  # a stream's, so far
    generated: dict[int, int] = field(default_factory=dict)  # tokens generated per row, for the metrics
    cached: dict[int, int] = field(default_factory=dict)  # finished rows' prompt tokens taken from the prefix cache
    closed: bool = False


def load_engine(folder: Path, device: str) -> tuple[BlockingGenerate, str]:
    """The engine the build configured in the model's version folder, and what it is, for the log."""
    synthetic = folder / SYNTHETIC_CONFIG_FILE
    if synthetic.is_file():  # a benchmark instrument (build_engines.py --engine synthetic)
        config = SyntheticConfig(**json.loads(synthetic.read_text()))
        return SyntheticEngine(config), f"synthetic benchmark engine, {config.step_ms} ms per step"
    engine_config = EngineConfig(**json.loads((folder / ENGINE_CONFIG_FILE).read_text()))
    if device != "cpu":
        engine_config = dataclasses.replace(engine_config, device=device)  # the GPU of this instance
    if engine_config.impl == LLAMACPP:
        from tritonllm.engine.llamacpp import LlamaCppEngine

        engine = LlamaCppEngine(engine_config)
        return engine, f"llama.cpp engine ({engine.description})"
    # The engine in a child process (tritonllm/engine/process.py), which alone then loads torch, or in this one.
    if engine_config.engine_process:
        return EngineProcess(engine_config), f"portable engine on {device}, in a process of its own"
    from tritonllm.engine.portable import PortableEngine

    return PortableEngine(engine_config), f"portable engine on {device}, in the model's process"


class EngineModel:
    def initialize(self, args: dict) -> None:
        config = model_config(args)
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError("tensorrt_llm must be decoupled: set model_transaction_policy { decoupled: true }")
        params = parameters(config)
        device = "cpu"
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        self.limits = Limits(int(params["max_input_len"]), int(params["max_seq_len"]), int(params["vocab_size"]))
        self.exclude_input = flag(params.get("exclude_input_in_output", "true"))
        # Requests beyond the running batch wait in the engine's queue, up to this bound; more are refused.
        self.capacity = int(config["max_batch_size"]) + int(params["max_queue_size"])
        folder = Path(args["model_repository"]) / args["model_version"]
        started = time.perf_counter()
        self.engine, what = load_engine(folder, device)
        # The batching manager's first step is slow (allocation, kernel selection): pay it now.
        self.engine.generate(GenerationRequest(input_ids=[0] * 16, max_new_tokens=4), timeout=300)
        log_info(f"tensorrt_llm: {what}, ready in {time.perf_counter() - started:.1f} s")
        self._live: dict[int, _Call] = {}
        self.metrics = EngineMetrics(args["model_name"], args["model_version"])
        self._finished: queue.SimpleQueue = queue.SimpleQueue()  # metric records, flushed by the sender thread
        self._outbox: Outbox[Emission] = Outbox(
            "tensorrt_llm-sender", self._send, Emission.merge, self._tick, CANCEL_CHECK_SECONDS, log_exception
        )

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                arrays = input_arrays(request, ENGINE_PARAMETER_INPUTS)
                if scalar(arrays, "stop", 0):
                    self._stop(request.request_id(), sender)
                    continue
                rows = parse_requests(arrays, self.limits)
                self._admit(len(rows))
                pad = arrays.get("pad_id")
                pad_id = int(pad.flat[0]) if pad is not None else 0
                counts = (
                    bool(scalar(arrays, "return_num_input_tokens", 0)),
                    bool(scalar(arrays, "return_num_output_tokens", 0)),
                )
                call = _Call(
                    sender,
                    request.request_id(),
                    rows,
                    exclude_input(arrays, self.exclude_input),
                    pad_id,
                    counts,
                    bool(scalar(arrays, "return_perf_metrics", 0)),
                    requested_outputs(request),
                )
            except Exception as exc:
                kind = "server_busy" if isinstance(exc, ServerBusy) else "invalid_input"
                self._finished.put(("error", kind))
                sender.send(error_response(exc), flags=FINAL)
                continue
            self._live[id(call)] = call
            try:
                for row, generation in enumerate(rows):
                    call.submitted[row] = time.perf_counter()
                    call.engine_ids.append(
                        self.engine.submit(generation, lambda e, c=call, r=row: self._on_emission(c, r, e))
                    )
            except Exception as exc:  # this request fails alone; the rest of the batch still goes in
                self._refused(call, exc)
        return None

    def _refused(self, call: _Call, exc: Exception) -> None:
        """A row the engine did not take: the rows it took are cancelled, and the request ends once, with `exc`.

        Nothing was sent for the call before: a stream has one row, and a batch is answered when all rows end.
        """
        self._close(call)
        self._finished.put(("error", "invalid_input" if isinstance(exc, ValueError) else "generation_failed"))
        call.sender.send(error_response(exc), flags=FINAL)

    def _admit(self, rows: int) -> None:
        in_flight = self.engine.running()
        if in_flight + rows > self.capacity:
            raise ServerBusy(
                f"server busy: {in_flight} requests are in the engine and its limit is {self.capacity} "
                "(max_batch_size running + max_queue_size waiting); retry later"
            )

    def _stop(self, request_id: str, sender) -> None:
        """TensorRT-LLM's `stop` input: end the in-flight requests that carry this request id."""
        if not request_id:
            raise InputError("stop", "a stop request must carry the id of the request to stop")
        if not self.engine.alive():  # so the health probe (tritonllm.launch.tritonserver.probe_engine) fails
            sender.send(error_response(EngineFailure("the engine's generation loop has stopped")), flags=FINAL)
            return
        for call in list(self._live.values()):
            if call.request_id == request_id:
                for engine_id in call.engine_ids:
                    self.engine.cancel(engine_id)
        sender.send(flags=FINAL)

    def _on_emission(self, call: _Call, row: int, emission: Emission) -> None:
        """From the engine's thread: queue what to send, never block."""
        request = call.requests[row]
        call.generated[row] = call.generated.get(row, 0) + len(emission.token_ids)
        if call.perf:
            call.times[row] = RowTimes.after(call.times.get(row), call.submitted[row], emission, call.generated[row])
        if emission.final:
            call.cached[row] = emission.cached_tokens
            self._finished.put(("finish", emission, len(request.input_ids), call.generated[row]))
        if emission.error or request.streaming:
            self._outbox.put(call, emission)
        elif emission.final:
            call.tokens[row] = ([] if call.exclude_input else request.input_ids) + emission.token_ids
            call.log_probs[row] = emission.log_probs or []
            if len(call.tokens) == len(call.requests):
                self._outbox.put(call, emission)

    def _tick(self) -> None:
        self._check_cancelled()
        self._update_metrics()

    def _update_metrics(self) -> None:
        while not self._finished.empty():
            record = self._finished.get()
            if record[0] == "error":
                self.metrics.errors[record[1]].increment(1)
                continue
            _, emission, input_tokens, output_tokens = record
            if emission.error:
                self.metrics.errors["generation_failed"].increment(1)
            self.metrics.finish(emission, input_tokens, output_tokens)
        self.metrics.load(self.engine.running(), self.engine.in_batch(), self.engine.captured_graphs())

    def _send(self, call: _Call, emission: Emission) -> None:
        """On the outbox's thread: a streaming request's new tokens, or a whole request's answer."""
        if call.closed:
            return
        if emission.error:
            self._close(call)
            call.sender.send(error_response(EngineFailure(f"generation failed: {emission.error}")), flags=FINAL)
            return
        streaming = call.requests[0].streaming
        final = emission.final and (streaming or len(call.tokens) == len(call.requests))
        if final:
            self._close(call)
        if streaming:
            outputs = self._stream_outputs(call, emission) if emission.token_ids or final else None
        else:
            outputs = self._outputs(call, [call.tokens[r] for r in range(len(call.requests))], call.log_probs)
        if outputs is None:
            call.sender.send(flags=FINAL)
        else:
            call.sender.send(
                pb_utils.InferenceResponse(output_tensors=to_tensors(outputs, call.wanted)), flags=FINAL if final else 0
            )

    def _stream_outputs(self, call: _Call, emission: Emission) -> dict | None:
        """A stream's new tokens; the final response also carries the token counts asked for. None: nothing to send."""
        outputs = self._outputs(call, [emission.token_ids], {0: emission.log_probs or []}, emission.final)
        if "cum_log_probs" in outputs:  # TensorRT-LLM's is the sum so far
            call.cum_log_prob += float(outputs["cum_log_probs"].sum())
            outputs["cum_log_probs"][:] = call.cum_log_prob
        if not emission.token_ids and not (emission.final and (any(call.counts) or call.perf)):
            return None
        return outputs

    def _outputs(self, call: _Call, sequences: list[list[int]], log_probs: dict, final: bool = True) -> dict:
        """The tensors of a response: ids and lengths, and the log probs and token counts the request asked for."""
        wanted = call.requests[0].log_probs
        rows = [log_probs.get(r) for r in range(len(sequences))] if wanted >= 0 else None
        outputs = pack_outputs(sequences, call.pad_id, rows, top=max(wanted, 0))
        if final and call.counts[0]:
            outputs["num_input_tokens"] = np.array([[len(r.input_ids)] for r in call.requests], dtype=np.int32)
        if final and call.counts[1]:
            outputs["num_output_tokens"] = np.array(
                [[call.generated.get(r, 0)] for r in range(len(call.requests))], dtype=np.int32
            )
        if call.perf:  # on every response, as TensorRT-LLM's executor: the counts and times so far
            rows = range(len(call.requests))
            outputs.update(
                perf_outputs(
                    [len(r.input_ids) for r in call.requests],
                    [call.generated.get(r, 0) for r in rows],
                    [call.cached.get(r, 0) for r in rows],
                    call.arrival,
                    [call.times.get(r) for r in rows],
                )
            )
        return outputs

    def _close(self, call: _Call) -> None:
        call.closed = True
        self._live.pop(id(call), None)
        for engine_id in call.engine_ids:
            self.engine.cancel(engine_id)  # no-op for finished requests; frees the others' batch slots

    def _check_cancelled(self) -> None:
        for call in list(self._live.values()):
            if call.sender.is_cancelled():
                for engine_id in call.engine_ids:
                    self.engine.cancel(engine_id)

    def finalize(self) -> None:
        self.engine.shutdown()
        self._outbox.close()
        # The model is in reference cycles (its sender thread holds its bound methods), so without this its
        # metric families would be freed at interpreter exit, after the stub's IPC is gone: a segfault there.
        self.metrics = None
