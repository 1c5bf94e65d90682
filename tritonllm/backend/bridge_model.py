"""Triton adapter of `tensorrt_llm` in the default deployment: the engine's request/response face.

HTTP /infer and gRPC ModelInfer refuse decoupled models, and a decoupled step would make the
ensemble decoupled. So, as NVIDIA's `decoupled_mode: false` deployment, `tensorrt_llm` answers each
request once: this non-decoupled model forwards it to the decoupled engine model (`tensorrt_llm_decoupled`,
which tensorrt_llm_bls streams from) and answers with the engine's final response: to the engine's own process
where it runs in one (tritonllm/link/engine_client.py), else through BLS. A batch is sent row by row and answered
in row order. Its `execute` returns at once and a worker thread answers through the response sender, so one
instance keeps every request in flight at the same time (a plain `execute` would run them one after another).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonllm.backend.adapter_admin import AdapterAdmin, lora_action
from tritonllm.backend.admission import BoundedWorkers
from tritonllm.backend.triton_glue import (
    ENGINE_PARAMETER_INPUTS,
    FINAL,
    error_response,
    exec_decoupled,
    input_arrays,
    model_config,
    parameters,
    raise_if_error,
    requested_outputs,
    settle_after,
    to_tensors,
)
from tritonllm.engine.health import EngineHealth
from tritonllm.errors import InputError
from tritonllm.link.engine_calls import answer_stop
from tritonllm.link.engine_client import client_for
from tritonllm.link.engine_io import stack_rows
from tritonllm.text.model_config import read_config
from tritonllm.text.wire import scalar

# What NVIDIA's decoupled_mode false deployment cannot answer in one response, and how to get it here.
DECOUPLED_ONLY = (
    "tensorrt_llm and ensemble answer once in this deployment (NVIDIA's decoupled_mode false): build with "
    "--decoupled-mode (make build BUILD_ARGS=--decoupled-mode), where they stream over gRPC, a response per sequence"
)


class BridgeModel:
    def initialize(self, args: dict) -> None:
        config = model_config(args)
        params = parameters(config)
        self.engine_model = params["engine_model_name"]
        # The ensemble asks for every output it maps; the engine is asked only for those it has (the TensorRT-LLM
        # flavor's lacks the portable engine's additions, and Triton refuses a request for an unknown output).
        engine = read_config(Path(args["model_repository"]).parent / self.engine_model / "config.pbtxt")
        self.engine_outputs = {output.name for output in engine.output}
        # Inputs declared with `reshape` arrive without their dims; the engine expects them back.
        self.reshaped = {i["name"]: [int(d) for d in i["dims"]] for i in config["input"] if "reshape" in i}
        self.workers = BoundedWorkers(int(params["max_inflight_requests"]), "tensorrt_llm")
        self.client = client_for(Path(args["model_repository"]).parent, self.engine_model)  # None: through BLS
        self._health: dict[int, EngineHealth] = {}  # the health probe's, per engine process

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                arrays = input_arrays(request, ENGINE_PARAMETER_INPUTS)
                if scalar(arrays, "streaming", 0):
                    raise InputError("streaming", f"{DECOUPLED_ONLY}; or stream text through tensorrt_llm_bls")
                for row in range(arrays["input_ids"].shape[0] if "input_ids" in arrays else 1):
                    if (scalar(arrays, "num_return_sequences", row) or 1) > 1:
                        raise InputError("num_return_sequences", f"more than 1: {DECOUPLED_ONLY}")
                wanted = requested_outputs(request)
                rows = self._rows(arrays)
                asked = sorted(wanted) if wanted else ["output_ids", "sequence_length"]
                outputs = [name for name in asked if name in self.engine_outputs]
                pad = arrays.get("pad_id")
                pad_id = int(pad.reshape(-1)[0]) if pad is not None else 0
                self.workers.submit(self._forward, rows, outputs, wanted, pad_id, request.request_id(), sender)
            except Exception as exc:
                sender.send(error_response(exc), flags=FINAL)
        return None

    def _rows(self, arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The engine's inputs for each batch row (a `stop` request is one row)."""
        batch = max((a.shape[0] for a in arrays.values()), default=1)
        return [
            {
                name: self._shaped(name, array[row % array.shape[0] : row % array.shape[0] + 1])
                for name, array in arrays.items()
            }
            for row in range(batch)
        ]

    def _shaped(self, name: str, array: np.ndarray) -> np.ndarray:
        return array.reshape(array.shape[0], *self.reshaped[name]) if name in self.reshaped else array

    def _forward(
        self, rows: list[dict], outputs: list[str], wanted: set[str] | None, pad_id: int, request_id: str, sender
    ) -> None:
        iterators: list = []
        try:
            one = self._direct if self.client is not None else self._one
            answers = [one(arrays, outputs, request_id, iterators) for arrays in rows]
            tensors = stack_rows(answers, pad_id)
            answer = pb_utils.InferenceResponse(output_tensors=to_tensors(tensors, wanted))
        except Exception as exc:
            answer = error_response(exc)
        settle_after(sender, iterators)  # only this thread asks this sender: a real round trip
        sender.send(answer, flags=FINAL)

    def _one(self, arrays: dict, outputs: list[str], request_id: str, iterators: list) -> dict[str, np.ndarray]:
        """One row's final answer from the engine model (empty for a `stop` request), its outputs as arrays."""
        engine_request = pb_utils.InferenceRequest(
            model_name=self.engine_model,
            inputs=[pb_utils.Tensor(name, array) for name, array in arrays.items()],
            requested_output_names=outputs,
            request_id=request_id,
        )
        answer: dict[str, np.ndarray] = {}
        for response in exec_decoupled(engine_request, iterators):
            raise_if_error(response)
            if response.output_tensors():
                answer = {t.name(): np.array(t.as_numpy(), copy=True) for t in response.output_tensors()}
        return answer

    def _direct(self, arrays: dict, outputs: list[str], request_id: str, _: list) -> dict[str, np.ndarray]:
        """One row's final answer from the engine's own process, as the engine model would have given it."""
        client = self.client
        if (action := lora_action(arrays)) is not None:
            return AdapterAdmin(client.engine()).answer(action, arrays)
        if scalar(arrays, "stop", 0):
            engine = client.engine()
            health = self._health.setdefault(id(engine), EngineHealth(engine))
            answer_stop(request_id, health, client.stop)
            return {}
        answer: dict[str, np.ndarray] = {}
        for response in client.open(arrays, request_id, set(outputs)):
            answer = response
        return answer

    def finalize(self) -> None:
        # Queued requests are served too: each is owed a final response, which a cancelled one never gets.
        self.workers.shutdown(wait=True)
        if self.client is not None:
            self.client.close()
