"""Triton adapter of `tensorrt_llm_bridge`: the engine, request/response.

A decoupled step would make the whole ensemble decoupled, and HTTP /infer refuses decoupled
models. This non-decoupled model forwards each request to the decoupled engine (BLS) and answers
with the engine's final response. Its `execute` returns at once and a worker thread answers
through the response sender, so one instance keeps every request in flight at the same time
(a plain `execute` would run them one after another).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import triton_python_backend_utils as pb_utils

from tritonllm.backend.model_config import read_config
from tritonllm.backend.triton_glue import (
    FINAL,
    error_response,
    exec_decoupled,
    input_arrays,
    model_config,
    parameters,
    raise_if_error,
    settle_after,
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
        self.workers = ThreadPoolExecutor(int(params["max_inflight_requests"]), thread_name_prefix="bridge")

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = [
                    pb_utils.Tensor(
                        name, array.reshape(array.shape[0], *self.reshaped[name]) if name in self.reshaped else array
                    )
                    for name, array in input_arrays(request).items()
                ]
                requested = request.requested_output_names() or ["output_ids", "sequence_length"]
                outputs = [name for name in requested if name in self.engine_outputs]
            except Exception as exc:
                sender.send(error_response(exc), flags=FINAL)
                continue
            self.workers.submit(self._forward, inputs, list(outputs), sender)
        return None

    def _forward(self, inputs: list, outputs: list[str], sender) -> None:
        iterators: list = []
        try:
            engine_request = pb_utils.InferenceRequest(
                model_name=self.engine_model, inputs=inputs, requested_output_names=outputs
            )
            answer = None
            for response in exec_decoupled(engine_request, iterators):
                raise_if_error(response)
                if response.output_tensors():
                    answer = pb_utils.InferenceResponse(output_tensors=response.output_tensors())
            if answer is None:
                answer = error_response(RuntimeError(f"{self.engine_model} sent no output"))
        except Exception as exc:
            answer = error_response(exc)
        settle_after(sender, iterators)  # only this thread asks this sender: a real round trip
        sender.send(answer, flags=FINAL)

    def finalize(self) -> None:
        self.workers.shutdown(wait=True, cancel_futures=True)
