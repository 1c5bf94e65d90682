"""An engine request in the names of TensorRT-LLM's LLM API: `SamplingParams` and `GuidedDecodingParams` arguments.

Names and rules are those of `tensorrt_llm/sampling_params.py` as read for the pinned release (docs/llmapi.md lists
each with its source line). What the engine interface asks that SamplingParams has no field for is done beside it:
- stop words end a request in tritonllm/engine/lifecycle.py, as in every engine: the tokens are checked as they come
  and the request is aborted on a match (SamplingParams' `stop_token_ids` stops on single tokens only, and strips
  them from the output, which TensorRT-LLM's C++ executor does not);
- bad words and the embedding bias go through `TokenRules`, a per-request `LogitsProcessor`: `bad_token_ids` bans
  single tokens only, and `embedding_bias` wants the whole vocabulary's tensor.
Everything here is plain Python; `TokenRules` touches torch only when TensorRT-LLM calls it, in NVIDIA's image.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonllm.engine.api import GenerationRequest, Guide, ends_with
from tritonllm.errors import InputError
from tritonllm.protocol import MAX_TOP_LOG_PROBS

AFTER_TEMPERATURE, BEFORE_TEMPERATURE, IGNORED = "after the temperature", "before the temperature", "ignored"


@dataclass(frozen=True)
class SamplerRules:
    """How one release's sampler reads the fields where the releases differ (tests/standins/tensorrt_llm/surface.py
    has each with its source)."""

    name: str  # "TensorRT-LLM 1.4's TorchSampler", for messages
    # Where presence and frequency are subtracted: the C++ sampler's kernel after dividing the logits by the
    # temperature; 1.4's TorchSampler before it; 1.2.1's TorchSampler not at all (TensorRT-LLM PR #16485 added them).
    penalties: str
    # logprobs=0: the sampled token's log probability alone (1.4); on 1.2.1, 0 is falsy and asks for none.
    chosen_alone: bool
    # SamplingParams.logprobs_mode exists (1.4; its default, RAW, is the model's logits before any sampling control):
    # the processed distribution, which the token was drawn from, is asked for, as the C++ sampler returns it.
    logprobs_mode: bool


SAMPLER_RULES = {
    ("1.2.1", "TRTLLMSampler"): SamplerRules("TensorRT-LLM 1.2.1's TRTLLMSampler", AFTER_TEMPERATURE, False, False),
    ("1.2.1", "TorchSampler"): SamplerRules("TensorRT-LLM 1.2.1's TorchSampler", IGNORED, False, False),
    ("1.4", "TorchSampler"): SamplerRules("TensorRT-LLM 1.4's TorchSampler", BEFORE_TEMPERATURE, True, True),
}


def check_sampler(request: GenerationRequest, rules: SamplerRules) -> None:
    """InputError, naming the input, for a control the release's sampler would silently drop."""
    if rules.penalties != IGNORED:
        return
    penalties = request.penalties
    for name, used in (
        ("repetition_penalty", penalties.repetition != 1.0),
        ("presence_penalty", penalties.presence != 0.0),
        ("frequency_penalty", penalties.frequency != 0.0),
    ):
        if used:
            raise InputError(name, f"{rules.name} ignores penalties: rebuild with --llm-api-sampler TRTLLMSampler")


# Guide types (protocol.GUIDE_TYPES) -> GuidedDecodingParams field and value: TensorRT-LLM's GuideType names map to
# json_object (any JSON), json (a schema), regex and grammar (EBNF) in its own _get_guided_decoding_params.
_GUIDE_FIELDS = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}


def guided_decoding_kwargs(guide: Guide) -> dict:
    field = _GUIDE_FIELDS[guide.type]
    return {field: True} if field == "json_object" else {field: guide.text}


def sampling_kwargs(request: GenerationRequest, rules: SamplerRules) -> dict:
    """SamplingParams(**kwargs) for one engine request (n = 1: the engine model sends each of num_return_sequences
    as a request of its own, with its own seed, as the other engines take them), for the release's sampler. The
    enum-valued logprobs_mode is added by the engine, which has the release's LogprobMode."""
    kwargs: dict = {
        "max_tokens": request.max_new_tokens,
        # The postprocessing model detokenizes; the prompt is added back by the engine model when asked.
        "detokenize": False,
        "exclude_input_from_output": True,
    }
    if request.end_id >= 0:
        kwargs["end_id"] = request.end_id  # pad_id follows it (SamplingParams.__post_init__)
    else:  # -1: never stop on a token. end_id stays unset: the LLM then takes the tokenizer's, which this ignores.
        kwargs["ignore_eos"] = True
    sampling = request.sampling
    if sampling.sample:  # greedy when temperature, top_k and top_p are all unset (params_imply_greedy_decoding)
        kwargs |= {"temperature": sampling.temperature, "seed": sampling.seed}
        if sampling.top_k > 0:
            kwargs["top_k"] = sampling.top_k
        if sampling.top_p < 1.0:
            kwargs["top_p"] = sampling.top_p
    penalties = request.penalties
    if request.end_id >= 0:  # the end id banned for the first tokens: nothing to ban without one
        kwargs["min_tokens"] = penalties.min_tokens
    if penalties.repetition != 1.0:
        kwargs["repetition_penalty"] = penalties.repetition
    if penalties.presence or penalties.frequency:
        # The engine request's are for before the temperature (the engine model scaled a TensorRT-LLM-rule request's
        # by its temperature, tritonllm/link/engine_io.py): a sampler that subtracts them after dividing the
        # logits by the temperature gets them divided by the temperature this draw uses. A greedy request is sent no
        # temperature: its values stay as they are, which keeps the engine flavor's argmax. OpenAI's rule counts the
        # generated tokens only: prompt_ignore_length leaves the prompt's out.
        scale = sampling.temperature if sampling.sample and rules.penalties == AFTER_TEMPERATURE else 1.0
        if not penalties.count_prompt:
            kwargs["prompt_ignore_length"] = len(request.input_ids)
        kwargs["presence_penalty"] = penalties.presence / scale
        kwargs["frequency_penalty"] = penalties.frequency / scale
    if request.log_probs >= 0:  # the chosen token's, read from the k most likely (tritonllm/engine/llmapi.py)
        least = 0 if rules.chosen_alone else 1
        kwargs["logprobs"] = min(max(request.log_probs, least), MAX_TOP_LOG_PROBS)
    return kwargs


def token_rules(request: GenerationRequest) -> TokenRules | None:
    """The request's logits processor, when it bans words or biases tokens."""
    if not request.bad_words and not request.embedding_bias:
        return None
    return TokenRules(request.bad_words, request.embedding_bias)


class TokenRules:
    """Bad words and the embedding bias on one request's logits, in place, as TensorRT-LLM's `LogitsProcessor.__call__`
    is called: (req_id, logits, token_ids, stream_ptr, client_id), `token_ids` one list per beam. A word's last token
    is banned where the sequence ends with the rest of it (TensorRT-LLM's banWords rule); the bias is added to the
    logits of its tokens. The engine registers it under the release's LogitsProcessor (tritonllm/engine/llmapi.py),
    an abstract base with this one method; it is pickled to TensorRT-LLM's workers, so it holds plain values only
    until its first call."""

    def __init__(self, bad_words: tuple[tuple[int, ...], ...], bias: tuple[tuple[int, float], ...]) -> None:
        self.bad_words = bad_words
        self.bias_ids = [token for token, _ in bias]
        self.bias_values = [value for _, value in bias]
        self._bias = None  # a tensor on the logits' device, made at the first call

    def banned(self, tokens: list[int]) -> list[int]:
        return [word[-1] for word in self.bad_words if ends_with(tokens, word[:-1])]

    def __call__(self, req_id, logits, token_ids, stream_ptr, client_id) -> None:
        if self.bias_ids:
            if self._bias is None:
                import torch

                self._bias = torch.tensor(self.bias_values, dtype=logits.dtype, device=logits.device)
            logits[..., self.bias_ids] += self._bias
        banned = self.banned(token_ids[0])  # one beam: the engine model refuses beam_width above 1
        if banned:
            logits[..., banned] = float("-inf")
