"""The engine model's requests, whoever carries them: a Triton request to `tensorrt_llm` (tritonllm/backend/
engine_model.py), or one that `tensorrt_llm_bls` or the bridge hands straight to the engine's own process
(tritonllm/link/engine_client.py). Each is read here into a `Call` of engine requests by the same rules
(engine_io.parse_requests), admitted against the same bound, and each emission of the engine becomes the same
outputs, so the two ways in answer alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tritonllm.engine.adapters import AdapterTable
from tritonllm.engine.api import (
    ENGINE_CONFIG_FILE,
    LLAMACPP,
    BlockingGenerate,
    Emission,
    EngineConfig,
    GenerationRequest,
)
from tritonllm.engine.health import EngineHealth
from tritonllm.engine.synthetic import SYNTHETIC_CONFIG_FILE, SyntheticConfig
from tritonllm.errors import EngineFailure, ErrorKind, InputError, ServerBusy
from tritonllm.link.engine_io import RowTimes, exclude_input, pack_outputs, parse_requests, perf_outputs
from tritonllm.protocol import ERRORS_IN_BAND, HEALTH_PROBE_ID, KV_EVENTS_ENV
from tritonllm.text.model_config import flag
from tritonllm.text.wire import Limits, scalar


@dataclass(frozen=True)
class EngineSettings:
    """What the engine model checks requests against, from its config's parameters."""

    limits: Limits
    exclude_input: bool  # exclude_input_in_output when a request does not say
    capacity: int  # requests running and waiting in the engine, at most

    @classmethod
    def of(cls, params: dict[str, str], max_batch_size: int) -> EngineSettings:
        return cls(
            Limits(int(params["max_input_len"]), int(params["max_seq_len"]), int(params["vocab_size"])),
            flag(params.get("exclude_input_in_output", "true")),
            max_batch_size + int(params["max_queue_size"]),
        )


def engine_scope(folder: Path, server_pid: int | None = None) -> str:
    """What the instances of one server's engine model share an engine's process by: the server's process (a stub's
    parent, unless given) and a container's host name."""
    return f"{socket.gethostname()}:{server_pid or os.getppid()}:{folder.resolve()}"


def engine_config(folder: Path, device: str) -> EngineConfig:
    """The portable engine's configuration in the engine model's version `folder`, for an instance on `device`."""
    config = EngineConfig(**json.loads((folder / ENGINE_CONFIG_FILE).read_text()))
    if device != "cpu":
        config = dataclasses.replace(config, device=device)  # the GPU of this instance
    if events := os.environ.get(KV_EVENTS_ENV):  # a Dynamo worker's server (tritonllm/dynamo)
        config = dataclasses.replace(config, kv_events=events)
    return config


def process_config(folder: Path, device: str) -> EngineConfig | SyntheticConfig | None:
    """The configuration of the engine the build put in the engine model's version `folder` when it runs in a
    process of its own, on `device` (the engine model's instance's); None for an engine in the model's process."""
    synthetic = folder / SYNTHETIC_CONFIG_FILE
    if synthetic.is_file():
        config = SyntheticConfig(**json.loads(synthetic.read_text()))
        return config if config.engine_process else None
    if not (folder / ENGINE_CONFIG_FILE).is_file():  # the LLM API's, or NVIDIA's C++ engine
        return None
    config = engine_config(folder, device)
    return config if config.engine_process and config.impl != LLAMACPP else None


def error_label(kind: ErrorKind | None) -> str:
    """The errors counter's label for a request answered with an error of `kind` (triton_glue.error_kind): the
    client's fault, the engine being full, or anything else (an engine failure or a bug of ours)."""
    if kind in (ErrorKind.INVALID_INPUT, ErrorKind.TOO_LARGE):
        return "invalid_input"
    return "server_busy" if kind is ErrorKind.BUSY else "generation_failed"


@dataclass(frozen=True)
class Finished:
    """A request the engine finished, as the metrics count it."""

    emission: Emission  # its final emission: finish reason and timings
    input_tokens: int
    output_tokens: int
    adapter: str = ""  # its LoRA adapter's name; "" for the base model


@dataclass(eq=False)
class Call:
    """One request to the engine model: its generations (engine requests), who answers it and what it asked for."""

    sender: object  # the Triton response sender, or the engine client's stream
    request_id: str  # the client's request id ("" when none), the key of `stop` requests
    generations: list[Generation]
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

    def guided(self) -> bool:
        return any(g.request.guide is not None for g in self.generations)


@dataclass(eq=False)
class Generation:
    """One engine request of a call, answered with responses of its own."""

    call: Call
    request: GenerationRequest
    batch_index: int
    sequence_index: int
    engine_id: str = ""
    submitted: float = 0.0  # when handed to the engine
    generated: int = 0  # tokens so far
    cached: int = 0  # prompt tokens the prefix cache served, known at the end
    cum_log_prob: float = 0.0  # a stream's, so far
    times: RowTimes | None = None

    def took(self, emission: Emission) -> None:
        """An emission of this generation's, as it arrives: its counts and times."""
        self.generated += len(emission.token_ids)
        if self.call.perf:
            self.times = RowTimes.after(self.times, self.submitted, emission, self.generated)
        if emission.final:
            self.cached = emission.cached_tokens

    def sends(self, emission: Emission) -> bool:
        """Whether the emission makes a response: a stream's every one, else the error or the end."""
        return bool(emission.error) or self.request.streaming or emission.final


def new_call(
    arrays: dict[str, np.ndarray],
    settings: EngineSettings,
    adapters: AdapterTable,
    sender: object,
    request_id: str,
    wanted: set[str] | None,
) -> Call:
    """A `tensorrt_llm` request's arrays as a call (raises InputError naming what it cannot take)."""
    generations = parse_requests(arrays, settings.limits, adapters)
    pad = arrays.get("pad_id")
    call = Call(
        sender,
        request_id,
        [],
        exclude_input(arrays, settings.exclude_input),
        int(pad.flat[0]) if pad is not None else 0,
        (bool(scalar(arrays, "return_num_input_tokens", 0)), bool(scalar(arrays, "return_num_output_tokens", 0))),
        bool(scalar(arrays, "return_perf_metrics", 0)),
        wanted,
        errors_in_band=bool(scalar(arrays, ERRORS_IN_BAND, 0)),
    )
    call.generations = [Generation(call, g.request, g.batch_index, g.sequence_index) for g in generations]
    call.open = len(call.generations)
    call.indexed = (any(g.batch_index for g in generations), any(g.sequence_index for g in generations))
    return call


def admit(engine: BlockingGenerate, rows: int, capacity: int, compiling: int = 0) -> None:
    """ServerBusy when `rows` more engine requests would pass `capacity` (every caller's, the engine's count)."""
    in_flight = engine.running() + compiling
    if in_flight + rows > capacity:
        raise ServerBusy(
            f"server busy: {in_flight} requests are in the engine and its limit is {capacity} "
            "(max_batch_size running + max_queue_size waiting); retry later"
        )


def answer_stop(request_id: str, health: EngineHealth, stop: Callable[[str], None]) -> None:
    """TensorRT-LLM's `stop` input: the in-flight requests that carry `request_id` end (`stop` ends them); the health
    probe's (tritonllm.launch.tritonserver.probe_engine) is answered from the engine's health. Raises what the stop
    request is answered with."""
    if not request_id:
        raise InputError("stop", "a stop request must carry the id of the request to stop")
    if request_id == HEALTH_PROBE_ID:
        problem = health.problem()
        if problem:
            raise EngineFailure(problem)
        return
    if not health.engine.alive():  # a client's stop to a dead engine: said, not silently a success
        raise EngineFailure("the engine's generation loop has stopped")
    stop(request_id)


def generation_outputs(generation: Generation, emission: Emission) -> dict | None:
    """A response's arrays: the generation's tokens (with the prompt, when asked, in a whole answer), and the log
    probs, token counts, perf metrics and indices it asked for. None: nothing to send (a stream's end without tokens
    and without counts)."""
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
