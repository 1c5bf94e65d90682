"""Triton adapter of `tensorrt_llm_bls`: the ensemble's tensors, streamed.

A decoupled step makes an ensemble decoupled, and a stateless postprocessing step cannot
detokenize a stream correctly; so this decoupled model runs the pipeline itself, per request:
`preprocessing` -> `tensorrt_llm` with `streaming` (BLS, decoupled) -> a `TextStream` that
holds the request's decode state. The first two steps are wired exactly as in the `ensemble`
config, read at load time, so the two entry points cannot drift apart. The preprocessing step runs
here, as the preprocessing model's own code with its config's parameters: a BLS round trip to that
model would add to the first token's wait (docs/performance.md, "First streamed text").

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonllm.backend.engine_io import log_probs_wanted
from tritonllm.backend.model_config import read_config
from tritonllm.backend.outbox import Outbox
from tritonllm.backend.text_models import preprocessor
from tritonllm.backend.triton_glue import (
    FINAL,
    error_response,
    exec_decoupled,
    flag,
    input_arrays,
    log_error,
    log_exception,
    model_config,
    parameters,
    raise_if_error,
    requested_outputs,
    to_tensors,
)
from tritonllm.errors import InputError
from tritonllm.protocol import PERF_OUTPUTS, stop_request_tensors
from tritonllm.text.detokenization import Detokenizer, finish_reason
from tritonllm.text.stream import TextStream
from tritonllm.text.wire import as_text, scalar

CANCEL_CHECK_SECONDS = 0.2


class _Cancelled(Exception):
    pass


@dataclass(eq=False)
class _Request:
    """One client request as the sender thread sees it."""

    sender: object
    wanted: set[str] | None = None  # the outputs the client asked for (None: all; triton_glue.requested_outputs)
    cancelled: bool = False  # set by the sender thread, read by the request's worker
    engine_id: str | None = None  # its engine request's id, once being sent: the key of its `stop` request
    stopped: bool = False  # the sender thread sent a `stop` request for it
    answered: bool = False  # the engine answered it once: its worker stops it at the next response
    log_probs: int = -1  # as the engine's GenerationRequest.log_probs: -1 none, k the top k too
    iterators: list = field(default_factory=list)  # its BLS response iterators, kept until settled


@dataclass
class _Delta:
    """What a streamed response carries: new text and, when the request asked, its new tokens' log probs."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top_log_probs: list[np.ndarray] = field(default_factory=list)  # one [k] row per token
    top_ids: list[np.ndarray] = field(default_factory=list)

    def extend(self, other: _Delta) -> _Delta:
        self.text += other.text
        self.ids += other.ids
        self.log_probs += other.log_probs
        self.top_log_probs += other.top_log_probs
        self.top_ids += other.top_ids
        return self

    def tensors(self, with_log_probs: bool, top: int) -> dict[str, np.ndarray]:
        # One dimension, as NVIDIA's tensorrt_llm_bls answers: its clients read `text_output[0]` as bytes.
        tensors = {"text_output": np.array([self.text.encode()], dtype=object)}
        if with_log_probs:
            tensors["output_ids"] = np.array([[self.ids]], dtype=np.int32).reshape(1, 1, -1)
            tensors["output_log_probs"] = np.array([[self.log_probs]], dtype=np.float32).reshape(1, 1, -1)
        if top:
            shape = (1, 1, len(self.ids), top)
            tensors["top_log_probs"] = np.array(self.top_log_probs, dtype=np.float32).reshape(shape)
            tensors["top_log_prob_ids"] = np.array(self.top_ids, dtype=np.int32).reshape(shape)
        return tensors


@dataclass
class _Whole(_Delta):
    """A request's whole answer (its deltas when not streaming), the sum of its log probs, and the perf metrics
    (KV cache counts, times) of the engine's final response when the request asked for them."""

    cum_log_prob: float = 0.0
    perf: dict[str, np.ndarray] = field(default_factory=dict)


def _output(response, name: str) -> np.ndarray:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    if tensor is None:
        raise RuntimeError(f"the engine's response has no {name}")
    return tensor.as_numpy()


def _joinable(earlier, later) -> bool:
    """Consecutive deltas join; a final response stays apart."""
    return isinstance(earlier, _Delta) and isinstance(later, _Delta)


def _join_deltas(run: list[_Delta]) -> _Delta:
    return functools.reduce(_Delta.extend, run)


class StreamingModel:
    def initialize(self, args: dict) -> None:
        config = model_config(args)
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError("tensorrt_llm_bls must be decoupled: set model_transaction_policy { decoupled: true }")
        params = parameters(config)
        repository = Path(args["model_repository"]).parent
        ensemble = read_config(repository / params["ensemble_model_name"] / "config.pbtxt")
        self.preprocess_step, self.engine_step = ensemble.ensemble_scheduling.step[:2]
        preprocessing = read_config(repository / self.preprocess_step.model_name / "config.pbtxt")
        self.preprocessor = preprocessor({k: v.string_value for k, v in preprocessing.parameters.items()})
        self.engine_model = params["engine_model_name"]
        self.detokenizer = Detokenizer(self.preprocessor.tokenizer, flag(params["skip_special_tokens"]))
        self.workers = ThreadPoolExecutor(int(params["max_inflight_requests"]), thread_name_prefix="bls")
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
            self._live[id(state)] = state
            self.workers.submit(self._generate, arrays, state)
        return None

    # ------------------------------------------------------------------ the sender thread

    def _send(self, state: _Request, item) -> None:
        """A text delta, or the final response (a text delta is never sent after it)."""
        if isinstance(item, _Delta):
            tensors = item.tensors(state.log_probs >= 0, max(state.log_probs, 0))
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
            if state.cancelled and not state.stopped and state.engine_id is not None and not state.answered:
                state.stopped = True
                self._stop_engine(state)

    def _ask_cancelled(self, state: _Request) -> None:
        """A round trip through the stub's helper thread. Only this thread asks, so none is
        answered early by another's, and every iterator that finished before it is settled after it."""
        settled = len(self._unsettled)
        state.cancelled = state.sender.is_cancelled()
        del self._unsettled[:settled]

    # ------------------------------------------------------------------ one request, on a worker thread

    def _generate(self, arrays: dict[str, np.ndarray], state: _Request) -> None:
        try:
            streaming = bool(scalar(arrays, "stream", 0))
            if (scalar(arrays, "beam_width", 0) or 1) != 1:
                raise InputError("beam_width", "tensorrt_llm_bls answers one beam: call ensemble for beam search")
            if (scalar(arrays, "num_return_sequences", 0) or 1) != 1:
                raise InputError(
                    "num_return_sequences",
                    "tensorrt_llm_bls streams one sequence per request: send one request per sequence (with seeds "
                    "of their own), or call ensemble in the decoupled deployment (--decoupled-mode)",
                )
            state.log_probs = log_probs_wanted(arrays, 0)
            tensors = dict(arrays)
            tensors.update(self._preprocess(arrays))
            stops = (
                [as_text(v, "stop_words") for v in arrays["stop_words"].reshape(-1)] if "stop_words" in arrays else []
            )
            stream = TextStream(self.detokenizer, stops)
            whole = self._run_engine(tensors, stream, state, streaming)
            whole.text += stream.finish()
            if not streaming and scalar(arrays, "exclude_input_in_output", 0) is False:
                prompt = tensors["_INPUT_ID"].reshape(-1)[: int(tensors["_REQUEST_INPUT_LEN"].reshape(-1)[0])]
                whole.text = self.detokenizer.decode(prompt.tolist()) + whole.text
            max_tokens = int(scalar(arrays, "max_tokens", 0))
            final = whole.tensors(not streaming and state.log_probs >= 0, 0 if streaming else max(state.log_probs, 0))
            final["finish_reason"] = np.array(
                [finish_reason(stream.stopped, stream.num_tokens, max_tokens).encode()], dtype=object
            )
            if scalar(arrays, "return_num_input_tokens", 0):
                final["num_input_tokens"] = tensors["_REQUEST_INPUT_LEN"].reshape(1, 1).astype(np.int32)
            if scalar(arrays, "return_num_output_tokens", 0):
                final["num_output_tokens"] = np.array([[stream.num_tokens]], dtype=np.int32)
            if state.log_probs >= 0:
                final["cum_log_probs"] = np.array([[whole.cum_log_prob]], dtype=np.float32)
            final.update(whole.perf)
            response = pb_utils.InferenceResponse(to_tensors(final, state.wanted))
        except _Cancelled:
            response = pb_utils.InferenceResponse(
                error=pb_utils.TritonError("request was cancelled", pb_utils.TritonError.CANCELLED)
            )
        except Exception as exc:
            response = error_response(exc)
        self.outbox.put(state, response)

    def _preprocess(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The ensemble's first step; returns its outputs under their ensemble tensor names."""
        step = self.preprocess_step
        inputs = {key: arrays[name] for key, name in step.input_map.items() if name in arrays and key != "STREAM"}
        (result,) = self.preprocessor.process([inputs])
        if isinstance(result, Exception):
            raise result
        return {step.output_map[name]: array for name, array in result.items() if name in step.output_map}

    def _run_engine(
        self, tensors: dict[str, np.ndarray], stream: TextStream, state: _Request, streaming: bool
    ) -> _Whole:
        """Stream the engine's tokens through `stream`; queue the deltas when `streaming`, else collect them."""
        step = self.engine_step
        inputs = [
            pb_utils.Tensor(key, tensors[name])
            for key, name in step.input_map.items()
            if name in tensors and key != "streaming"  # the decoupled ensemble maps it from `stream`
        ]
        inputs.append(pb_utils.Tensor("streaming", np.array([[True]])))
        request_id = str(next(self._ids))
        outputs = ["output_ids", "sequence_length"]
        if state.log_probs >= 0:
            outputs.append("output_log_probs")
        if state.log_probs > 0:
            outputs += ["top_log_probs", "top_log_prob_ids"]
        perf = bool(scalar(tensors, "return_perf_metrics", 0))
        if perf:
            outputs += list(PERF_OUTPUTS)
        request = pb_utils.InferenceRequest(
            model_name=self.engine_model, inputs=inputs, requested_output_names=outputs, request_id=request_id
        )
        whole = _Whole()
        stopping = False
        state.engine_id = request_id  # before the call: it returns with the engine's first response only
        last = None  # with perf: the engine's latest response, whose perf metrics are the request's
        for response in exec_decoupled(request, state.iterators):
            state.answered = True
            if perf and not response.has_error():
                last = response
            if stopping:
                if response.has_error():
                    break  # an error ends the request: nothing more will come
                continue  # drain until the engine's final response
            if response.has_error():
                raise_if_error(response)
            output = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if output is not None:
                length = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
                ids = output.as_numpy().reshape(-1)[:length].tolist()
                delta = _Delta(stream.push(ids))
                if state.log_probs >= 0:
                    delta.ids = ids
                    # TensorRT-LLM's streamed log probs are all those so far (its LLM API slices them the same
                    # way); the portable engine's are the response's own: the last `length` are this response's.
                    so_far = _output(response, "output_log_probs").reshape(-1)
                    delta.log_probs = so_far[len(so_far) - length :].tolist()
                    whole.cum_log_prob += sum(delta.log_probs)
                if state.log_probs > 0:
                    k = state.log_probs
                    delta.top_log_probs = list(_output(response, "top_log_probs").reshape(-1, k)[:length])
                    delta.top_ids = list(_output(response, "top_log_prob_ids").reshape(-1, k)[:length])
                if streaming and (delta.text or delta.ids):
                    self.outbox.put(state, delta)
                elif not streaming:
                    whole.extend(delta)
            if stream.stopped or state.cancelled:  # sent even if the sender thread did: its stop may have come first
                self._stop_engine(state)
                stopping = True
        if state.cancelled:
            raise _Cancelled
        # Read once, from the final response, which a stopped request still waits for (every response has them).
        for name in PERF_OUTPUTS if last is not None else ():
            tensor = pb_utils.get_output_tensor_by_name(last, name)
            if tensor is not None:
                whole.perf[name] = np.array(tensor.as_numpy()).reshape(1, 1)  # a copy
        return whole

    def _stop_engine(self, state: _Request) -> None:
        """TensorRT-LLM's way to end a request early: a request with the same id and `stop` set."""
        request_id = state.engine_id
        stop = pb_utils.InferenceRequest(
            model_name=self.engine_model,
            inputs=[pb_utils.Tensor(name, value) for name, value, _ in stop_request_tensors()],
            requested_output_names=["output_ids"],
            request_id=request_id,
        )
        for response in exec_decoupled(stop, state.iterators):
            if response.has_error():
                log_error(f"tensorrt_llm_bls: stopping engine request {request_id}: {response.error().message()}")

    def finalize(self) -> None:
        # Queued requests are served too: each is owed a final response, which a cancelled one never gets.
        self.workers.shutdown(wait=True)
        self.outbox.close()
