"""One streamed request between a client's tensors and the engine's: the per-request pipeline.

What does not depend on how tensors travel lives here, once: the request's checks, its engine request (the
ensemble's preprocessing step, wired as the ensemble wires it), the text of each engine response (incremental
decoding and stop strings, text/stream.py), its log probabilities, and the final response's fields (finish
reason, token counts, cumulative log probability, perf metrics). A carrier (tensorrt_llm_bls over BLS calls)
sends `engine_inputs()`, hands each engine response's outputs to `push`, ends the engine's work once `stopped`,
and sends the deltas and `final()`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tritonllm.errors import InputError
from tritonllm.protocol import PERF_OUTPUTS, STREAMING_MODEL
from tritonllm.text.detokenization import Detokenizer, finish_reason
from tritonllm.text.model_config import flag, read_config
from tritonllm.text.stream import TextStream
from tritonllm.text.tokenization import GUIDES_BY_ENGINE, Preprocessor
from tritonllm.text.tokenizer import load_tokenizer
from tritonllm.text.wire import Limits, as_text, log_probs_wanted, scalar


@dataclass(frozen=True)
class Wiring:
    """The ensemble's first two steps, each map from the step's tensor name to the ensemble's: what preprocessing
    reads and writes, and what the engine step reads."""

    preprocess_inputs: Mapping[str, str]
    preprocess_outputs: Mapping[str, str]
    engine_inputs: Mapping[str, str]


def tokenizer(params: dict[str, str]):
    """The tokenizer a text model's config parameters name."""
    return load_tokenizer(params["tokenizer_dir"], params.get("tokenizer_class", ""))


def preprocessor(params: dict[str, str]) -> Preprocessor:
    """The preprocessing model's step from its config's parameters."""
    limits = Limits(int(params["max_input_len"]), int(params["max_seq_len"]), int(params["vocab_size"]))
    return Preprocessor(
        tokenizer(params),
        limits,
        flag(params["add_special_tokens"]),
        int(params.get("max_beam_width", "1")),
        params.get("guided_decoding", GUIDES_BY_ENGINE),
    )


def streaming_parameters(repository: Path) -> tuple[str, str, bool]:
    """What `tensorrt_llm_bls` carries its pipelines with, from its config: the ensemble whose wiring it follows,
    the engine model it streams from, and whether special tokens are left out of the text."""
    params = {
        k: v.string_value for k, v in read_config(repository / STREAMING_MODEL / "config.pbtxt").parameters.items()
    }
    return params["ensemble_model_name"], params["engine_model_name"], flag(params["skip_special_tokens"])


@dataclass(frozen=True)
class Parts:
    """What every request of one repository shares: its wiring, the preprocessing model's step (from that model's
    config, so a request is tokenized as `ensemble` tokenizes it) and the detokenizer."""

    wiring: Wiring
    preprocessor: Preprocessor
    detokenizer: Detokenizer

    @classmethod
    def load(cls, repository: Path, ensemble: str, skip_special_tokens: bool) -> Parts:
        config = read_config(repository / ensemble / "config.pbtxt")
        pre, engine = config.ensemble_scheduling.step[:2]
        wiring = Wiring(dict(pre.input_map), dict(pre.output_map), dict(engine.input_map))
        params = read_config(repository / pre.model_name / "config.pbtxt").parameters
        step = preprocessor({key: value.string_value for key, value in params.items()})
        return cls(wiring, step, Detokenizer(step.tokenizer, skip_special_tokens))

    def request(
        self, arrays: dict[str, np.ndarray], prompt_ids: list[int] | None = None, token_ids: bool = False
    ) -> StreamedRequest:
        """`prompt_ids`: the prompt's tokens when the caller has them from `preprocessor.tokenize_prompt`.
        `token_ids`: every delta carries its tokens, for a caller that detokenizes them itself (Dynamo's frontend)."""
        return StreamedRequest(arrays, self.preprocessor, self.detokenizer, self.wiring, prompt_ids, token_ids)


@dataclass
class Delta:
    """What a streamed response carries: new text and, when the request asked, its new tokens' log probs."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top_log_probs: list[np.ndarray] = field(default_factory=list)  # one [k] row per token
    top_ids: list[np.ndarray] = field(default_factory=list)

    def extend(self, other: Delta) -> Delta:
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


def _output(outputs: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    array = outputs.get(name)
    if array is None:
        raise RuntimeError(f"the engine's response has no {name}")
    return array


class StreamedRequest:
    """One request: built from the client's tensors (raises InputError naming what it cannot take)."""

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        preprocessor: Preprocessor,
        detokenizer: Detokenizer,
        wiring: Wiring,
        prompt_ids: list[int] | None = None,
        token_ids: bool = False,
    ) -> None:
        self.token_ids = token_ids
        self.streaming = bool(scalar(arrays, "stream", 0))
        if (scalar(arrays, "beam_width", 0) or 1) != 1:
            raise InputError("beam_width", "tensorrt_llm_bls answers one beam: call ensemble for beam search")
        if (scalar(arrays, "num_return_sequences", 0) or 1) != 1:
            raise InputError(
                "num_return_sequences",
                "tensorrt_llm_bls streams one sequence per request: send one request per sequence (with seeds "
                "of their own), or call ensemble in the decoupled deployment (--decoupled-mode)",
            )
        self.log_probs = log_probs_wanted(arrays, 0)  # as GenerationRequest.log_probs: -1 none, k the top k too
        self.detokenizer = detokenizer
        self.wiring = wiring
        self._arrays = arrays
        self._tensors = {**arrays, **self._preprocess(arrays, preprocessor, prompt_ids)}
        self.max_tokens = int(scalar(arrays, "max_tokens", 0))  # there: preprocessing refuses a request without it
        stops = [as_text(v, "stop_words") for v in arrays["stop_words"].reshape(-1)] if "stop_words" in arrays else []
        self.stream = TextStream(detokenizer, stops)
        self.perf = bool(scalar(self._tensors, "return_perf_metrics", 0))
        self._whole = Delta()  # the deltas, when not streaming
        self._cum_log_prob = 0.0
        self.perf_metrics: dict[str, np.ndarray] = {}  # the engine's final response's, set by the carrier
        self.abort: Callable[[], None] | None = None  # while the carrier streams: ends the engine's work at once

    def _preprocess(
        self, arrays: dict[str, np.ndarray], preprocessor: Preprocessor, prompt_ids: list[int] | None
    ) -> dict[str, np.ndarray]:
        """The ensemble's first step; its outputs under their ensemble tensor names."""
        wiring = self.wiring
        inputs = {key: arrays[name] for key, name in wiring.preprocess_inputs.items() if name in arrays}
        inputs.pop("STREAM", None)
        (result,) = preprocessor.process([inputs], [prompt_ids])
        if isinstance(result, Exception):
            raise result
        return {wiring.preprocess_outputs[name]: a for name, a in result.items() if name in wiring.preprocess_outputs}

    # ------------------------------------------------------------------ the engine request

    def engine_inputs(self) -> dict[str, np.ndarray]:
        """The engine step's inputs, always streaming (the decoupled ensemble maps `streaming` from `stream`)."""
        tensors = self._tensors
        inputs = {
            key: tensors[name]
            for key, name in self.wiring.engine_inputs.items()
            if name in tensors and key != "streaming"
        }
        inputs["streaming"] = np.array([[True]])
        return inputs

    def engine_outputs(self) -> list[str]:
        outputs = ["output_ids", "sequence_length"]
        if self.log_probs >= 0:
            outputs.append("output_log_probs")
        if self.log_probs > 0:
            outputs += ["top_log_probs", "top_log_prob_ids"]
        if self.perf:
            outputs += list(PERF_OUTPUTS)
        return outputs

    # ------------------------------------------------------------------ the engine's responses

    @property
    def stopped(self) -> bool:
        """A stop string ended the text: the engine's work should end."""
        return self.stream.stopped

    def push(self, outputs: Mapping[str, np.ndarray]) -> Delta | None:
        """One engine response's outputs; the delta to stream now, or None (nothing new, or not streaming)."""
        ids_array = outputs.get("output_ids")
        if ids_array is None:
            return None
        length = int(_output(outputs, "sequence_length").reshape(-1)[0])
        ids = ids_array.reshape(-1)[:length].tolist()
        delta = Delta(self.stream.push(ids))
        if self.log_probs >= 0 or self.token_ids:
            delta.ids = ids
        if self.log_probs >= 0:
            # TensorRT-LLM's streamed log probs are all those so far (its LLM API slices them the same way); the
            # portable engine's are the response's own: the last `length` are this response's either way.
            so_far = _output(outputs, "output_log_probs").reshape(-1)
            delta.log_probs = so_far[len(so_far) - length :].tolist()
            self._cum_log_prob += sum(delta.log_probs)
        if self.log_probs > 0:
            k = self.log_probs
            delta.top_log_probs = list(_output(outputs, "top_log_probs").reshape(-1, k)[:length])
            delta.top_ids = list(_output(outputs, "top_log_prob_ids").reshape(-1, k)[:length])
        if not self.streaming:
            self._whole.extend(delta)
            return None
        return delta if delta.text or delta.ids else None

    def delta_tensors(self, delta: Delta) -> dict[str, np.ndarray]:
        return delta.tensors(self.log_probs >= 0, max(self.log_probs, 0))

    def final(self, perf: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The last response's tensors: the text not sent yet (all of it, when not streaming), the finish reason,
        the counts and sums asked for, and `perf`, the engine's final response's perf metrics."""
        whole = self._whole
        whole.text += self.stream.finish()
        arrays = self._arrays
        if not self.streaming and scalar(arrays, "exclude_input_in_output", 0) is False:
            prompt = self._tensors["_INPUT_ID"].reshape(-1)[: int(self._tensors["_REQUEST_INPUT_LEN"].reshape(-1)[0])]
            whole.text = self.detokenizer.decode(prompt.tolist()) + whole.text
        streaming = self.streaming
        final = whole.tensors(not streaming and self.log_probs >= 0, 0 if streaming else max(self.log_probs, 0))
        reason = finish_reason(self.stream.stopped, self.stream.num_tokens, self.max_tokens)
        final["finish_reason"] = np.array([reason.encode()], dtype=object)
        if scalar(arrays, "return_num_input_tokens", 0):
            final["num_input_tokens"] = self._tensors["_REQUEST_INPUT_LEN"].reshape(1, 1).astype(np.int32)
        if scalar(arrays, "return_num_output_tokens", 0):
            final["num_output_tokens"] = np.array([[self.stream.num_tokens]], dtype=np.int32)
        if self.log_probs >= 0:
            final["cum_log_probs"] = np.array([[self._cum_log_prob]], dtype=np.float32)
        for name, value in (perf or {}).items():
            final[name] = np.array(value).reshape(1, 1)  # a copy
        return final
