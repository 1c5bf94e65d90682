"""Triton adapters of the tokenizer and detokenizer models (run inside the Python-backend stub)."""

from __future__ import annotations

from tritonllm.backend.triton_glue import flag, model_config, parameters, run_batch
from tritonllm.text.detokenization import Detokenizer, Postprocessor
from tritonllm.text.tokenization import GUIDES_BY_ENGINE, Preprocessor
from tritonllm.text.tokenizer import load_tokenizer
from tritonllm.text.wire import Limits


def tokenizer(params: dict[str, str]):
    """The tokenizer a text model's config parameters name."""
    return load_tokenizer(params["tokenizer_dir"], params.get("tokenizer_class", ""))


def preprocessor(params: dict[str, str]) -> Preprocessor:
    """The preprocessing model's step from its config's parameters (tensorrt_llm_bls runs the same one)."""
    limits = Limits(int(params["max_input_len"]), int(params["max_seq_len"]), int(params["vocab_size"]))
    return Preprocessor(
        tokenizer(params),
        limits,
        flag(params["add_special_tokens"]),
        int(params.get("max_beam_width", "1")),
        params.get("guided_decoding", GUIDES_BY_ENGINE),
    )


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
