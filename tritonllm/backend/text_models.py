"""Triton adapters of the tokenizer and detokenizer models (run inside the Python-backend stub)."""

from __future__ import annotations

from tritonllm.backend.triton_glue import model_config, parameters, run_batch
from tritonllm.text.detokenization import Detokenizer, Postprocessor
from tritonllm.text.model_config import flag
from tritonllm.text.pipeline import preprocessor, tokenizer


class PreprocessingModel:
    def initialize(self, args: dict) -> None:
        self.preprocessor = preprocessor(parameters(model_config(args)))

    def execute(self, requests: list) -> list:
        return run_batch(requests, self.preprocessor.process)


class PostprocessingModel:
    def initialize(self, args: dict) -> None:
        params = parameters(model_config(args))
        self.postprocessor = Postprocessor(Detokenizer(tokenizer(params), flag(params["skip_special_tokens"])))

    def execute(self, requests: list) -> list:
        return run_batch(requests, self.postprocessor.process)
