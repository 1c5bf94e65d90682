"""Stand-ins of tensorrt_llm/sampling_params.py's SamplingParams, GuidedDecodingParams, LogitsProcessor and (1.4)
LogprobMode: the release's field names and defaults (surface.py), keyword-only as there, and the checks its
`_validate` makes."""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod

from tensorrt_llm.surface import GUIDED_DECODING_FIELDS, LOGPROB_MODES, SAMPLING_PARAMS_FIELDS

# The fields whose default is not None (S:204-273).
_DEFAULTS = {
    "max_tokens": 32,
    "include_stop_str_in_output": False,
    "apply_batched_logits_processor": False,
    "n": 1,
    "use_beam_search": False,
    "return_context_logits": False,
    "return_generation_logits": False,
    "exclude_input_from_output": True,
    "return_encoder_output": False,
    "return_perf_metrics": False,
    "ignore_eos": False,
    "detokenize": True,
    "add_special_tokens": True,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "logprobs_simple_format": False,  # 1.4
    "prompt_logprobs_simple_format": False,  # 1.4
}
if LOGPROB_MODES:
    LogprobMode = enum.StrEnum("LogprobMode", {mode.upper(): mode for mode in LOGPROB_MODES})
    LogprobMode.__module__ = __name__
    _DEFAULTS["logprobs_mode"] = LogprobMode.RAW


class LogitsProcessor(ABC):
    @abstractmethod
    def __call__(self, req_id, logits, token_ids, stream_ptr, client_id) -> None: ...


def _guided_post_init(self) -> None:
    given = sum(1 for name in GUIDED_DECODING_FIELDS if getattr(self, name))
    if given > 1:
        raise ValueError(f"Only one guide can be used for a request, but got {given}.")


GuidedDecodingParams = dataclasses.make_dataclass(
    "GuidedDecodingParams",
    [
        (name, object, dataclasses.field(default=False if name == "json_object" else None))
        for name in GUIDED_DECODING_FIELDS
    ],
    namespace={"__post_init__": _guided_post_init},
    kw_only=True,
)


def _implies_greedy(params) -> bool:
    """S:339-355 params_imply_greedy_decoding."""
    unset = params.temperature is None and params.top_p is None and params.top_k is None
    return unset or params.top_k == 1 or params.top_p == 0.0 or params.temperature == 0


def _post_init(self) -> None:
    """S:278-334: pad_id follows end_id, best_of follows n, then _validate's checks; a boolean logprobs is 1 or
    none on 1.2.1 (S:332-333), 0 or none on 1.4 (C1 sampling.py ~450-453)."""
    if isinstance(self.logprobs, bool):
        self.logprobs = (0 if LOGPROB_MODES else 1) if self.logprobs else None
    if self.pad_id is None:
        self.pad_id = self.end_id
    self.best_of = self.best_of or self.n
    if self.top_p is not None and not 0 <= self.top_p <= 1:
        raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
    if self.top_k is not None and self.top_k < 0:
        raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
    if self.temperature is not None and self.temperature < 0:
        raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
    if self.best_of < self.n:
        raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
    if self.best_of > 1 and not self.use_beam_search and _implies_greedy(self):
        raise ValueError("Greedy decoding in the LLM API does not allow multiple returns.")
    if self.logits_processor is not None and not isinstance(self.logits_processor, LogitsProcessor):
        raise TypeError("logits_processor must be a LogitsProcessor")
    if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
        raise TypeError("guided_decoding must be a GuidedDecodingParams")


SamplingParams = dataclasses.make_dataclass(
    "SamplingParams",
    [(name, object, dataclasses.field(default=_DEFAULTS.get(name))) for name in SAMPLING_PARAMS_FIELDS],
    namespace={"__post_init__": _post_init},
    kw_only=True,
)
# Picklable, as the release's are: its requests travel pickled to the worker processes.
SamplingParams.__module__ = GuidedDecodingParams.__module__ = __name__
