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

import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import triton_python_backend_utils as pb_utils

from tritonllm.backend.adapter_admin import AdapterAdmin, lora_action
from tritonllm.backend.metrics import EngineMetrics
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
    LLAMACPP,
    BlockingGenerate,
    Emission,
    GenerationRequest,
)
from tritonllm.engine.health import EngineHealth
from tritonllm.engine.llmapi_config import LLM_API_CONFIG_FILE
from tritonllm.engine.process import EngineProcess
from tritonllm.engine.synthetic import SYNTHETIC_CONFIG_FILE, SyntheticConfig, SyntheticEngine
from tritonllm.errors import EngineFailure, ErrorKind
from tritonllm.link.engine_calls import (
    Call,
    EngineSettings,
    Finished,
    Generation,
    admit,
    answer_stop,
    engine_config,
    engine_scope,
    error_label,
    generation_outputs,
    new_call,
    process_config,
)
from tritonllm.text.wire import scalar

CANCEL_CHECK_SECONDS = 0.2  # and the period of the load gauges
# Guided requests are handed to the engine from these threads: compiling a new grammar takes up to seconds, and
# Triton's execute thread must not wait on it (nor the `stop` requests and the other requests queued behind it).
GUIDED_SUBMITTERS = 4


def load_engine(
    folder: Path,
    device: str,
    on_stop: Callable[[str], None] = lambda request_id: None,
    on_records: Callable[[list], None] = lambda records: None,
) -> tuple[BlockingGenerate, str]:
    """The engine the build configured in the model's version folder, and what it is, for the log. An engine in a
    process of its own is shared by the model's instances on the same device of the same server, and reached by the
    other fronts too (tritonllm/link/engine_client.py); it calls `on_stop` for the `stop` requests any of them
    received, and `on_records` with the metrics records of the others in the one that reports them."""
    own = process_config(folder, device)
    if own is not None:
        what = "synthetic benchmark engine" if isinstance(own, SyntheticConfig) else f"portable engine on {device}"
        return EngineProcess(own, engine_scope(folder), on_stop, on_records), f"{what}, in a process of its own"
    synthetic = folder / SYNTHETIC_CONFIG_FILE
    if synthetic.is_file():  # a benchmark instrument (build_engines.py --engine synthetic)
        config = SyntheticConfig(**json.loads(synthetic.read_text()))
        return SyntheticEngine(config), f"synthetic benchmark engine, {config.step_ms} ms per step"
    llm_api = folder / LLM_API_CONFIG_FILE
    if llm_api.is_file():  # build_engines.py --engine trtllm-llmapi: TensorRT-LLM's LLM API, in NVIDIA's image
        from tritonllm.engine.llmapi import LlmApiEngine

        engine = LlmApiEngine(json.loads(llm_api.read_text()))
        return engine, f"TensorRT-LLM {engine.api.version} LLM API engine"
    config = engine_config(folder, device)
    if config.impl == LLAMACPP:
        from tritonllm.engine.llamacpp import LlamaCppEngine

        engine = LlamaCppEngine(config)
        return engine, f"llama.cpp engine ({engine.description})"
    from tritonllm.engine.portable import PortableEngine

    return PortableEngine(config), f"portable engine on {device}, in the model's process"


class EngineModel:
    def initialize(self, args: dict) -> None:
        config = model_config(args)
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError("tensorrt_llm must be decoupled: set model_transaction_policy { decoupled: true }")
        params = parameters(config)
        device = "cpu"
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        # Requests beyond the running batch wait in the engine's queue, up to its capacity; more are refused.
        self.settings = EngineSettings.of(params, int(config["max_batch_size"]))
        folder = Path(args["model_repository"]) / args["model_version"]
        started = time.perf_counter()
        self._live: dict[int, Call] = {}
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
                wanted = requested_outputs(request)
                call = new_call(arrays, self.settings, self.engine.adapters, sender, request.request_id(), wanted)
                admit(self.engine, len(call.generations), self.settings.capacity, self._compiling)
            except Exception as exc:
                self._finished.put(error_label(error_kind(exc)))
                sender.send(error_response(exc), flags=FINAL)
                continue
            self._live[id(call)] = call
            if call.guided():
                self._count_compiling(len(call.generations))
                self._guided.submit(self._submit, call, True)
            else:
                self._submit(call)
        return None

    def _submit(self, call: Call, guided: bool = False) -> None:
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

    def _refused(self, call: Call, exc: Exception) -> None:
        """A generation the engine did not take: those it took are cancelled, and the request ends with `exc`; the
        closed call sends nothing more (a generation taken before may have been answered already). The refusal
        goes out through the outbox, the one thread that answers calls: on a guided submitter's, its final response
        could come while the outbox asks the call whether it was cancelled (see outbox.py on tritonserver 2.51)."""
        self._close(call)
        self._finished.put(error_label(error_kind(exc)))
        self._outbox.put(call, exc)

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
        """TensorRT-LLM's `stop` input (engine_calls.answer_stop), relayed to every caller of a shared engine."""
        try:
            answer_stop(request_id, self._health, self._relay_stop)
        except Exception as exc:
            sender.send(error_response(exc), flags=FINAL)
            return
        sender.send(flags=FINAL)

    def _relay_stop(self, request_id: str) -> None:
        if not self.engine.relay_stop(request_id):
            self._stop_calls(request_id)

    def _stop_calls(self, request_id: str) -> None:
        """Ends this instance's calls that carry the client's request id (from the engine's thread, when relayed)."""
        for call in list(self._live.values()):
            if call.request_id == request_id:
                self._cancel(call)

    def _on_emission(self, generation: Generation, emission: Emission) -> None:
        """From the engine's thread: queue what to send, never block."""
        generation.took(emission)
        if emission.final:
            request = generation.request
            self._finished.put(Finished(emission, len(request.input_ids), generation.generated, request.adapter))
        if generation.sends(emission):
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

    def _send(self, key: Generation | Call, item: Emission | Exception) -> None:
        """On the outbox's thread: a stream's new tokens, a generation's whole answer, or a refused call's error."""
        if isinstance(key, Call):  # its one item (a key of its own: never joined with an emission)
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
            outputs = generation_outputs(generation, emission)
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

    def _fail(self, call: Call, exc: BaseException) -> None:
        """On the outbox's thread: the call's final response, its error (in band where it asked: ERRORS_IN_BAND)."""
        in_band = call.errors_in_band and call.answered
        response = in_band_error_response(exc) if in_band else error_response(exc)
        call.sender.send(response, flags=FINAL)

    def _close(self, call: Call) -> None:
        call.closed = True
        self._live.pop(id(call), None)
        self._cancel(call)  # no-op for finished generations; frees the others' batch slots

    def _cancel(self, call: Call) -> None:
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
