"""Triton adapter of `tensorrt_llm_bls`: the ensemble's tensors, streamed.

A decoupled step makes an ensemble decoupled, and a stateless postprocessing step cannot
detokenize a stream correctly; so this decoupled model runs the pipeline itself, per request:
`preprocessing` -> `tensorrt_llm` with `streaming` (BLS, decoupled) -> a `TextStream` that
holds the request's decode state: the per-request pipeline of tritonllm/text/pipeline.py, which this model
carries over BLS calls. The first two steps are wired exactly as in the `ensemble` config, read at load time,
so the two entry points cannot drift apart. The preprocessing step runs here, as the preprocessing model's own
code with its config's parameters: a BLS round trip to that model would add to the first token's wait
(docs/performance.md, "First streamed text").

Each request runs on a worker thread (`execute` returns at once) that only queues its text; one
`Outbox` thread sends it, merging a stream's deltas that queued up while it was busy, and asks the
server every CANCEL_CHECK_SECONDS which requests were cancelled (each `send` and `is_cancelled` is a
round trip to the server: per token they would cost more than the generation under a heavy GPU load).
A client that cancels, or a stop string, ends the engine's work with TensorRT-LLM's `stop` request,
which both engines honour.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonllm.backend.admission import BoundedWorkers
from tritonllm.backend.outbox import Outbox
from tritonllm.backend.triton_glue import (
    FINAL,
    error_response,
    exec_decoupled,
    input_arrays,
    log_error,
    log_exception,
    model_config,
    parameters,
    raise_if_error,
    requested_outputs,
    to_tensors,
)
from tritonllm.errors import InputError, ServerBusy
from tritonllm.link.engine_client import EngineStream, client_for
from tritonllm.protocol import ERRORS_IN_BAND, GENERATION_ERROR, PERF_OUTPUTS, stop_request_tensors
from tritonllm.text.model_config import flag, read_config
from tritonllm.text.pipeline import Delta, Parts, StreamedRequest

CANCEL_CHECK_SECONDS = 0.2
DRAIN_SECONDS = 30.0  # at unload, how long requests carried by the engine's process may take to finish


class _Cancelled(Exception):
    pass


@dataclass(eq=False)
class _Request:
    """One client request as the sender thread sees it."""

    sender: object
    wanted: set[str] | None = None  # the outputs the client asked for (None: all; triton_glue.requested_outputs)
    cancelled: bool = False  # set by the sender thread, read by the request's worker
    engine: _BlsStream | EngineStream | None = None  # its engine request, once being sent
    stopped: bool = False  # the sender thread sent a `stop` request for it
    answered: bool = False  # the engine answered it once: its worker stops it at the next response
    pipeline: StreamedRequest | None = None  # made on its worker thread
    iterators: list = field(default_factory=list)  # its BLS response iterators, kept until settled


def _joinable(earlier, later) -> bool:
    """Consecutive deltas join; a final response stays apart."""
    return isinstance(earlier, Delta) and isinstance(later, Delta)


def _join_deltas(run: list[Delta]) -> Delta:
    return functools.reduce(Delta.extend, run)


def _outputs(response, names) -> dict[str, np.ndarray]:
    """The response's outputs among `names`, as arrays."""
    tensors = ((name, pb_utils.get_output_tensor_by_name(response, name)) for name in names)
    return {name: tensor.as_numpy() for name, tensor in tensors if tensor is not None}


class _BlsStream:
    """An engine request through a decoupled BLS call to the engine model (an engine in that model's process, or
    NVIDIA's): its responses' output arrays, as EngineStream gives them from the engine's own process."""

    def __init__(self, model: str, request_id: str, inputs: dict, outputs: list[str], in_band: bool, keep: list):
        self.model, self.request_id, self.keep = model, request_id, keep
        tensors = [pb_utils.Tensor(name, array) for name, array in inputs.items()]
        if in_band:
            tensors.append(pb_utils.Tensor(ERRORS_IN_BAND, np.array([[True]])))
        self.outputs = outputs
        self.request = pb_utils.InferenceRequest(
            model_name=model,
            inputs=tensors,
            requested_output_names=outputs + ([GENERATION_ERROR] if in_band else []),
            request_id=request_id,
        )

    def __iter__(self):
        for response in exec_decoupled(self.request, self.keep):
            raise_if_error(response)
            yield _outputs(response, self.outputs)

    def stop(self) -> None:
        """TensorRT-LLM's way to end a request early: a request with the same id and `stop` set."""
        stop = pb_utils.InferenceRequest(
            model_name=self.model,
            inputs=[pb_utils.Tensor(name, value) for name, value, _ in stop_request_tensors()],
            requested_output_names=["output_ids"],
            request_id=self.request_id,
        )
        for response in exec_decoupled(stop, self.keep):
            if response.has_error():
                log_error(f"tensorrt_llm_bls: stopping engine request {self.request_id}: {response.error().message()}")


def _cancelled():
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError("request was cancelled", pb_utils.TritonError.CANCELLED)
    )


class _Carry:
    """One request's engine responses through its pipeline: each response's delta to the outbox as it comes, the
    engine's work stopped once a stop string or the client ends it (its responses then drained for the perf metrics
    of its last), and the final response. On the request's worker thread (a BLS call), or on the reader thread of the
    engine's own process (EngineClient's `listener`: no thread waits per request)."""

    def __init__(self, outbox: Outbox, pipeline: StreamedRequest, state: _Request) -> None:
        self.outbox, self.pipeline, self.state = outbox, pipeline, state
        self.stopping = False
        self.last: dict[str, np.ndarray] = {}  # the engine's latest response: its perf metrics are the request's

    def take(self, outputs: dict[str, np.ndarray]) -> None:
        state, pipeline = self.state, self.pipeline
        state.answered = True
        self.last = outputs
        if self.stopping:
            return  # drain until the engine's final response
        delta = pipeline.push(outputs)
        if delta is not None:
            self.outbox.put(state, delta)
        if pipeline.stopped or state.cancelled:  # even if the sender thread did: its stop may have come first
            state.engine.stop()
            self.stopping = True

    def perf(self) -> dict[str, np.ndarray]:
        return {name: self.last[name] for name in PERF_OUTPUTS if name in self.last} if self.pipeline.perf else {}

    def end(self, error: Exception | None) -> None:
        """The engine's work is over (with `error`, unless it came after the stop): the final response."""
        state = self.state
        try:
            if error is not None and not self.stopping:
                raise error
            if state.cancelled:
                raise _Cancelled
            response = pb_utils.InferenceResponse(to_tensors(self.pipeline.final(self.perf()), state.wanted))
        except _Cancelled:
            response = _cancelled()
        except Exception as exc:
            response = error_response(exc)
        self.outbox.put(state, response)


class StreamingModel:
    def initialize(self, args: dict) -> None:
        config = model_config(args)
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError("tensorrt_llm_bls must be decoupled: set model_transaction_policy { decoupled: true }")
        params = parameters(config)
        repository = Path(args["model_repository"]).parent
        self.parts = Parts.load(repository, params["ensemble_model_name"], flag(params["skip_special_tokens"]))
        self.engine_model = params["engine_model_name"]
        # An engine model of ours sends a late error in band when asked (protocol.ERRORS_IN_BAND); NVIDIA's C++ one
        # has no such input, and Triton refuses a request with an unknown input.
        engine = read_config(repository / self.engine_model / "config.pbtxt")
        self.in_band = any(i.name == ERRORS_IN_BAND for i in engine.input)
        self.workers = BoundedWorkers(int(params["max_inflight_requests"]), "tensorrt_llm_bls")
        self.client = client_for(repository, self.engine_model)  # None: the engine model is called through BLS
        # Engine request ids, unique per process: the key of `stop` requests (numeric, as TensorRT-LLM wants).
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)
        self._live: dict[int, _Request] = {}
        self._unsettled: list[list] = []  # iterators of cancelled requests, dropped after the next round trip
        self.outbox: Outbox[str | object] = Outbox(
            "tensorrt_llm_bls-sender",
            self._send,
            _joinable,
            _join_deltas,
            self._check_cancelled,
            CANCEL_CHECK_SECONDS,
            log_exception,
        )

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                arrays = input_arrays(request)
                batch = arrays["text_input"].shape[0] if "text_input" in arrays else 1
                if batch != 1:
                    raise InputError("text_input", f"tensorrt_llm_bls takes one prompt per request, got {batch}")
            except Exception as exc:
                sender.send(error_response(exc), flags=FINAL)
                continue
            state = _Request(sender, requested_outputs(request))
            self._live[id(state)] = state  # before its worker can end it
            try:
                self.workers.submit(self._generate, arrays, state)
            except ServerBusy as exc:
                self._live.pop(id(state), None)
                sender.send(error_response(exc), flags=FINAL)
        return None

    # ------------------------------------------------------------------ the sender thread

    def _send(self, state: _Request, item) -> None:
        """A text delta, or the final response (a text delta is never sent after it)."""
        if isinstance(item, Delta):
            tensors = state.pipeline.delta_tensors(item)
            state.sender.send(pb_utils.InferenceResponse(to_tensors(tensors, state.wanted)))
            return
        self._live.pop(id(state), None)
        if state.cancelled:  # the stub answers it without a round trip now: wait for another's
            self._unsettled.append(state.iterators)
        else:
            self._ask_cancelled(state)  # settles this request's iterators (see exec_decoupled)
        state.iterators = []
        state.sender.send(item, flags=FINAL)

    def _check_cancelled(self) -> None:
        for state in list(self._live.values()):
            if not state.cancelled:
                self._ask_cancelled(state)
            # Stopped from here, not only by its worker at the engine's next response: a request waiting
            # in the engine's queue gets none until it runs, and would keep its place until then.
            if state.cancelled and not state.stopped and state.engine is not None and not state.answered:
                state.stopped = True
                state.engine.stop()

    def _ask_cancelled(self, state: _Request) -> None:
        """A round trip through the stub's helper thread. Only this thread asks, so none is
        answered early by another's, and every iterator that finished before it is settled after it."""
        settled = len(self._unsettled)
        state.cancelled = state.sender.is_cancelled()
        del self._unsettled[:settled]

    # ------------------------------------------------------------------ one request, on a worker thread

    def _generate(self, arrays: dict[str, np.ndarray], state: _Request) -> None:
        try:
            state.pipeline = pipeline = self.parts.request(arrays)
            carry = _Carry(self.outbox, pipeline, state)
            if self.client is not None:  # the engine's own process: its reader thread carries the request on
                wanted = set(pipeline.engine_outputs())
                state.engine = self.client.prepare(pipeline.engine_inputs(), wanted=wanted, listener=carry)
                state.engine.start()
                return
            perf = self._run_engine(pipeline, state, carry)
            response = pb_utils.InferenceResponse(to_tensors(pipeline.final(perf), state.wanted))
        except _Cancelled:
            response = _cancelled()
        except Exception as exc:
            response = error_response(exc)
        self.outbox.put(state, response)

    def _run_engine(
        self, pipeline: StreamedRequest, state: _Request, carry: _Carry | None = None
    ) -> dict[str, np.ndarray]:
        """Streams the engine model's responses (a BLS call) through the pipeline on this worker thread; returns the
        perf metrics of the engine's final response (which a stopped request still waits for) when asked for."""
        carry = carry or _Carry(self.outbox, pipeline, state)
        request_id = str(next(self._ids))
        inputs, outputs = pipeline.engine_inputs(), pipeline.engine_outputs()
        state.engine = _BlsStream(self.engine_model, request_id, inputs, outputs, self.in_band, state.iterators)
        try:
            for response in state.engine:
                carry.take(response)
        except Exception:
            if not carry.stopping:
                raise  # an error after the stop ends the request: nothing more will come
        if state.cancelled:
            raise _Cancelled
        return carry.perf()

    def finalize(self) -> None:
        # Queued requests are served too: each is owed a final response, which a cancelled one never gets.
        self.workers.shutdown(wait=True)
        if self.client is not None:
            # Those the engine's process carries finish too, for a while; then closing fails the rest, their errors
            # queued for the outbox before it stops.
            deadline = time.monotonic() + DRAIN_SECONDS
            while self._live and time.monotonic() < deadline:
                time.sleep(0.05)
            self.client.close()
        self.outbox.close()
