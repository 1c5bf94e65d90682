"""Triton adapter of the portable engine: the decoupled `tensorrt_llm` model.

`execute` parses each request, hands it to the engine and returns at once (a guided one from a submitter
thread: compiling its grammar may take seconds); the engine's router
thread reports tokens, and an `Outbox` thread turns them into responses (merging a stream's tokens
that queued up while it was busy), so neither generation nor request intake ever waits on the
server's IPC. Like the TensorRT-LLM backend, each generation of a request (a batch row, or one of
its num_return_sequences) gets one response holding all its tokens, or when streaming a response
per new tokens, with its batch_index and sequence_index; the last response of the request carries
the COMPLETE_FINAL flag. A request ended early (TensorRT-LLM's `stop` request, or a cancelled
client) ends the same way, with the tokens generated until then.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonllm.backend.adapter_admin import AdapterAdmin, lora_action
from tritonllm.backend.engine_io import RowTimes, exclude_input, pack_outputs, parse_requests, perf_outputs
from tritonllm.backend.metrics import EngineMetrics, Finished, error_label
from tritonllm.backend.outbox import Outbox
from tritonllm.backend.triton_glue import (
    ENGINE_PARAMETER_INPUTS,
    FINAL,
    error_kind,
    error_response,
    free_before_exit,
    in_band_error_response,
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
from tritonllm.engine.health import EngineHealth
from tritonllm.engine.llmapi_config import LLM_API_CONFIG_FILE
from tritonllm.engine.process import EngineProcess
from tritonllm.engine.synthetic import SYNTHETIC_CONFIG_FILE, SyntheticConfig, SyntheticEngine
from tritonllm.errors import EngineFailure, ErrorKind, InputError, ServerBusy
from tritonllm.protocol import ERRORS_IN_BAND, HEALTH_PROBE_ID, KV_EVENTS_ENV
from tritonllm.text.model_config import flag
from tritonllm.text.wire import Limits, scalar

CANCEL_CHECK_SECONDS = 0.2  # and the period of the load gauges
# Guided requests are handed to the engine from these threads: compiling a new grammar takes up to seconds, and
# Triton's execute thread must not wait on it (nor the `stop` requests and the other requests queued behind it).
GUIDED_SUBMITTERS = 4


@dataclass(eq=False)
class _Call:
    """One Triton request: its generations (engine requests), its response sender and what it asked for."""

    sender: object
    request_id: str  # the client's request id ("" when none), the key of `stop` requests
    generations: list[_Generation]
    exclude_input: bool
    pad_id: int
    counts: tuple[bool, bool]  # return_num_input_tokens, return_num_output_tokens
    perf: bool  # return_perf_metrics: the KV cache block counts and the request's times (perf_outputs)
    wanted: set[str] | None  # the outputs the request asked for (triton_glue.requested_outputs)
    arrival: float = field(default_factory=time.perf_counter)  # the steady clock, as TensorRT-LLM's times
    open: int = 0  # generations not yet answered in full: the response that answers the last is FINAL
    # Whether responses carry batch_index, sequence_index: as TensorRT-LLM's backend, where there is more than one.
    indexed: tuple[bool, bool] = (False, False)
    closed: bool = False
    cancelled: bool = False  # asked to end: a generation handed to the engine after it is cancelled at once
    errors_in_band: bool = False  # ERRORS_IN_BAND: an error after a response goes as GENERATION_ERROR
    answered: bool = False  # a response went out


@dataclass(eq=False)
class _Generation:
    """One engine request of a call, answered with responses of its own (the outbox's key)."""

    call: _Call
    request: GenerationRequest
    batch_index: int
    sequence_index: int
    engine_id: str = ""
    submitted: float = 0.0  # when handed to the engine
    generated: int = 0  # tokens so far
    cached: int = 0  # prompt tokens the prefix cache served, known at the end
    cum_log_prob: float = 0.0  # a stream's, so far
    times: RowTimes | None = None


def load_engine(
    folder: Path,
    device: str,
    on_stop: Callable[[str], None] = lambda request_id: None,
    on_records: Callable[[list], None] = lambda records: None,
) -> tuple[BlockingGenerate, str]:
    """The engine the build configured in the model's version folder, and what it is, for the log. An engine in a
    process of its own is shared by the model's instances on the same device of the same server (a stub's parent
    process is the server); it calls `on_stop` for the `stop` requests any of them received, and `on_records` with
    the metrics records of the others in the one that reports them."""
    shared_as = f"{socket.gethostname()}:{os.getppid()}:{folder.resolve()}"  # a container's own host name
    synthetic = folder / SYNTHETIC_CONFIG_FILE
    if synthetic.is_file():  # a benchmark instrument (build_engines.py --engine synthetic)
        config = SyntheticConfig(**json.loads(synthetic.read_text()))
        what = f"synthetic benchmark engine, {config.step_ms} ms per step"
        if config.engine_process:
            return EngineProcess(config, shared_as, on_stop, on_records), f"{what}, in a process of its own"
        return SyntheticEngine(config), what
    llm_api = folder / LLM_API_CONFIG_FILE
    if llm_api.is_file():  # build_engines.py --engine trtllm-llmapi: TensorRT-LLM's LLM API, in NVIDIA's image
        from tritonllm.engine.llmapi import LlmApiEngine

        engine = LlmApiEngine(json.loads(llm_api.read_text()))
        return engine, f"TensorRT-LLM {engine.api.version} LLM API engine"
    engine_config = EngineConfig(**json.loads((folder / ENGINE_CONFIG_FILE).read_text()))
    if device != "cpu":
        engine_config = dataclasses.replace(engine_config, device=device)  # the GPU of this instance
    if events := os.environ.get(KV_EVENTS_ENV):  # a Dynamo worker's server (tritonllm/dynamo)
        engine_config = dataclasses.replace(engine_config, kv_events=events)
    if engine_config.impl == LLAMACPP:
        from tritonllm.engine.llamacpp import LlamaCppEngine

        engine = LlamaCppEngine(engine_config)
        return engine, f"llama.cpp engine ({engine.description})"
    # The engine in a child process (tritonllm/engine/process.py), which alone then loads torch, or in this one.
    if engine_config.engine_process:
        engine = EngineProcess(engine_config, shared_as, on_stop, on_records)
        return engine, f"portable engine on {device}, in a process of its own"
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
        self._live: dict[int, _Call] = {}
        self._finished: queue.SimpleQueue = queue.SimpleQueue()  # Finished or an error label, for _tick
        self.engine, what = load_engine(folder, device, self._stop_calls, self._take_records)
        # The batching manager's first step is slow (allocation, kernel selection): pay it now.
        self.engine.generate(GenerationRequest(input_ids=[0] * 16, max_new_tokens=4), timeout=300)
        self._health = EngineHealth(self.engine)
        log_info(f"tensorrt_llm: {what}, ready in {time.perf_counter() - started:.1f} s")
        # Of the instances sharing an engine, one registers the metrics; the others forward it their records.
        self._reports = self.engine.reports_metrics()
        adapters = list(self.engine.adapters.by_name)
        self.metrics = (
            EngineMetrics(args["model_name"], args["model_version"], device, adapters) if self._reports else None
        )
        self._outbox: Outbox[Emission | Exception] = Outbox(
            "tensorrt_llm-sender",
            self._send,
            Emission.joinable,
            Emission.join,
            self._tick,
            CANCEL_CHECK_SECONDS,
            log_exception,
        )
        self._guided = ThreadPoolExecutor(GUIDED_SUBMITTERS, thread_name_prefix="tensorrt_llm-guided")
        self._compiling = 0  # rows of guided requests not yet handed to the engine (admission counts them)
        self._compiling_lock = threading.Lock()
        self._unloading = False  # set by finalize: guided calls still queued are refused, not dropped
        # lora_action requests: a load waits for the step thread, an unload for the adapter's requests to finish.
        self._admin = AdapterAdmin(self.engine)
        self._administrators = ThreadPoolExecutor(2, thread_name_prefix="tensorrt_llm-adapters")

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                arrays = input_arrays(request, ENGINE_PARAMETER_INPUTS)
                if (action := lora_action(arrays)) is not None:
                    self._administrators.submit(self._administer, action, arrays, sender, requested_outputs(request))
                    continue
                if scalar(arrays, "stop", 0):
                    self._stop(request.request_id(), sender)
                    continue
                generations = parse_requests(arrays, self.limits, self.engine.adapters)
                self._admit(len(generations))
                pad = arrays.get("pad_id")
                counts = (
                    bool(scalar(arrays, "return_num_input_tokens", 0)),
                    bool(scalar(arrays, "return_num_output_tokens", 0)),
                )
                call = _Call(
                    sender,
                    request.request_id(),
                    [],
                    exclude_input(arrays, self.exclude_input),
                    int(pad.flat[0]) if pad is not None else 0,
                    counts,
                    bool(scalar(arrays, "return_perf_metrics", 0)),
                    requested_outputs(request),
                    errors_in_band=bool(scalar(arrays, ERRORS_IN_BAND, 0)),
                )
                call.generations = [_Generation(call, g.request, g.batch_index, g.sequence_index) for g in generations]
                call.open = len(call.generations)
                call.indexed = (
                    any(g.batch_index for g in generations),
                    any(g.sequence_index for g in generations),
                )
            except Exception as exc:
                self._finished.put(error_label(error_kind(exc)))
                sender.send(error_response(exc), flags=FINAL)
                continue
            self._live[id(call)] = call
            if any(g.request.guide is not None for g in call.generations):
                self._count_compiling(len(call.generations))
                self._guided.submit(self._submit, call, True)
            else:
                self._submit(call)
        return None

    def _submit(self, call: _Call, guided: bool = False) -> None:
        """Hands a call's generations to the engine; on a guided submitter thread for a guided call."""
        try:
            for generation in call.generations:
                if guided and self._unloading:  # queued behind the submitters: it is owed a final response
                    raise EngineFailure("the model is being unloaded: the request was not started")
                generation.submitted = time.perf_counter()
                generation.engine_id = self.engine.submit(
                    generation.request, lambda e, g=generation: self._on_emission(g, e)
                )
        except Exception as exc:  # this request fails alone; the rest of the batch still goes in
            self._refused(call, exc)
        else:
            # Cancelled, stopped or closed while being handed over (a guide compiling, or between `submit` returning
            # and its id being kept): that cancel missed the generations without an id.
            if call.cancelled:
                self._cancel(call)
        finally:
            if guided:
                self._count_compiling(-len(call.generations))

    def _count_compiling(self, rows: int) -> None:
        with self._compiling_lock:
            self._compiling += rows

    def _refused(self, call: _Call, exc: Exception) -> None:
        """A generation the engine did not take: those it took are cancelled, and the request ends with `exc`; the
        closed call sends nothing more (a generation taken before may have been answered already). The refusal
        goes out through the outbox, the one thread that answers calls: on a guided submitter's, its final response
        could come while the outbox asks the call whether it was cancelled (see outbox.py on tritonserver 2.51)."""
        self._close(call)
        self._finished.put(error_label(error_kind(exc)))
        self._outbox.put(call, exc)

    def _admit(self, rows: int) -> None:
        in_flight = self.engine.running() + self._compiling
        if in_flight + rows > self.capacity:
            raise ServerBusy(
                f"server busy: {in_flight} requests are in the engine and its limit is {self.capacity} "
                "(max_batch_size running + max_queue_size waiting); retry later"
            )

    def _administer(self, action: str, arrays: dict, sender, wanted: set[str] | None) -> None:
        """A lora_action request, answered with the adapters loaded once it is done (on an administrator thread)."""
        try:
            outputs = self._admin.answer(action, arrays)
            response = pb_utils.InferenceResponse(output_tensors=to_tensors(outputs, wanted))
        except Exception as exc:
            if error_kind(exc) is ErrorKind.INTERNAL:
                log_exception(f"tensorrt_llm: lora_action {action} failed")
            response = error_response(exc)
        sender.send(response, flags=FINAL)

    def _stop(self, request_id: str, sender) -> None:
        """TensorRT-LLM's `stop` input: end the in-flight requests that carry this request id; the health probe's
        (tritonllm.launch.tritonserver.probe_engine) is answered from the engine's health."""
        if not request_id:
            raise InputError("stop", "a stop request must carry the id of the request to stop")
        if request_id == HEALTH_PROBE_ID:
            problem = self._health.problem()
            if problem:
                sender.send(error_response(EngineFailure(problem)), flags=FINAL)
            else:
                sender.send(flags=FINAL)
            return
        if not self.engine.alive():  # a client's stop to a dead engine: said, not silently a success
            sender.send(error_response(EngineFailure("the engine's generation loop has stopped")), flags=FINAL)
            return
        if not self.engine.relay_stop(request_id):
            self._stop_calls(request_id)
        sender.send(flags=FINAL)

    def _stop_calls(self, request_id: str) -> None:
        """Ends this instance's calls that carry the client's request id (from the engine's thread, when relayed)."""
        for call in list(self._live.values()):
            if call.request_id == request_id:
                self._cancel(call)

    def _on_emission(self, generation: _Generation, emission: Emission) -> None:
        """From the engine's thread: queue what to send, never block."""
        generation.generated += len(emission.token_ids)
        if generation.call.perf:
            generation.times = RowTimes.after(generation.times, generation.submitted, emission, generation.generated)
        if emission.final:
            generation.cached = emission.cached_tokens
            request = generation.request
            self._finished.put(Finished(emission, len(request.input_ids), generation.generated, request.adapter))
        if emission.error or generation.request.streaming or emission.final:
            self._outbox.put(generation, emission)

    def _tick(self) -> None:
        self._check_cancelled()
        self._update_metrics()

    def _update_metrics(self) -> None:
        records = []
        while not self._finished.empty():
            records.append(self._finished.get())
        if not self._reports:  # another instance sharing the engine does: it gets ours
            if records:
                self.engine.forward_records(records)
            return
        if self.metrics is None:  # finalized
            return
        self.metrics.record(records)
        self.metrics.load(self.engine.running(), self.engine.in_batch(), self.engine.captured_graphs())

    def _take_records(self, records: list) -> None:
        """Another instance's metrics records, in the one that reports them (from the engine's thread)."""
        for record in records:
            self._finished.put(record)

    def _send(self, key: _Generation | _Call, item: Emission | Exception) -> None:
        """On the outbox's thread: a stream's new tokens, a generation's whole answer, or a refused call's error."""
        if isinstance(key, _Call):  # its one item (a key of its own: never joined with an emission)
            self._fail(key, item)
            return
        generation, emission = key, item
        call = generation.call
        if call.closed:
            return
        if emission.error:
            self._close(call)
            self._fail(call, emission.failure())
            return
        if emission.final:
            call.open -= 1
        final = call.open == 0
        try:  # built before the call closes: a failure still has the call to end
            outputs = self._outputs(generation, emission)
            tensors = None if outputs is None else to_tensors(outputs, call.wanted)
            if final:
                self._close(call)
            if tensors is not None:
                call.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)
                call.answered = True
            elif final:  # nothing to send but the end; one sequence's end of several is not the request's
                call.sender.send(flags=FINAL)
        except Exception as exc:  # the call ends with the error: without a final response its client would hang
            self._close(call)
            self._finished.put(error_label(error_kind(exc)))
            self._fail(call, exc)

    def _fail(self, call: _Call, exc: BaseException) -> None:
        """On the outbox's thread: the call's final response, its error (in band where it asked: ERRORS_IN_BAND)."""
        in_band = call.errors_in_band and call.answered
        response = in_band_error_response(exc) if in_band else error_response(exc)
        call.sender.send(response, flags=FINAL)

    def _outputs(self, generation: _Generation, emission: Emission) -> dict | None:
        """A response's tensors: the generation's tokens (with the prompt, when asked, in a whole answer), and the
        log probs, token counts, perf metrics and indices it asked for. None: nothing to send (a stream's end
        without tokens and without counts)."""
        call, request = generation.call, generation.request
        streaming = request.streaming
        if streaming and not emission.token_ids and not (emission.final and (any(call.counts) or call.perf)):
            return None
        tokens = emission.token_ids if streaming or call.exclude_input else request.input_ids + emission.token_ids
        wanted = request.log_probs
        log_probs = [emission.log_probs or []] if wanted >= 0 else None
        outputs = pack_outputs([tokens], call.pad_id, log_probs, top=max(wanted, 0))
        if "cum_log_probs" in outputs and streaming:  # TensorRT-LLM's is the sum so far
            generation.cum_log_prob += float(outputs["cum_log_probs"].sum())
            outputs["cum_log_probs"][:] = generation.cum_log_prob
        if call.counts[0]:
            outputs["num_input_tokens"] = np.array([[len(request.input_ids)]], dtype=np.int32)
        if call.counts[1]:  # as TensorRT-LLM, the output ids of this response: the prompt too when they hold it
            outputs["num_output_tokens"] = np.array([[len(tokens)]], dtype=np.int32)
        if call.perf:  # on every response, as TensorRT-LLM's executor: the counts and times so far
            outputs.update(
                perf_outputs(
                    len(request.input_ids),
                    generation.generated,
                    generation.cached,
                    call.arrival,
                    generation.times,
                    call.wanted,
                )
            )
        if call.indexed[0]:
            outputs["batch_index"] = np.array([[generation.batch_index]], dtype=np.int32)
        if call.indexed[1]:
            outputs["sequence_index"] = np.array([[generation.sequence_index]], dtype=np.int32)
        return outputs

    def _close(self, call: _Call) -> None:
        call.closed = True
        self._live.pop(id(call), None)
        self._cancel(call)  # no-op for finished generations; frees the others' batch slots

    def _cancel(self, call: _Call) -> None:
        call.cancelled = True
        for generation in call.generations:
            if generation.engine_id:
                self.engine.cancel(generation.engine_id)

    def _check_cancelled(self) -> None:
        """On the sender's thread, so never after a call's final response (the outbox's note on tritonserver 2.51)."""
        for call in list(self._live.values()):
            if call.sender.is_cancelled():
                self._cancel(call)

    def finalize(self) -> None:
        # Every call is answered: guided ones still queued are refused by the submitters, and the engine's shutdown
        # fails those it holds (a guided one compiling included), their errors sent by the outbox before it stops.
        self._unloading = True
        self._guided.shutdown(wait=True)
        self.engine.shutdown()  # fails the adapter loads and unloads still waiting
        self._administrators.shutdown(wait=True)
        self._outbox.close()
        # The model is in reference cycles (its sender thread holds its bound methods), so without this its
        # metric families would be freed at interpreter exit, after the stub's IPC is gone: a segfault there.
        self.metrics = None
        free_before_exit()  # answered calls, each in a cycle with its generations, hold their response senders
