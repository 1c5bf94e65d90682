"""The parts of TensorRT-LLM's LLM API the project uses, as read in NVIDIA's sources, for each release the flavor
runs on (tritonllm/versions.py LLM_API_RELEASES). TRITONLLM_STANDIN_RELEASE picks the release the stand-in is
(1.2.1 by default); the names below are that release's.

No stored copy of the 1.2.1 or 1.4.0rc4 tree could be read (the repository is too large to fetch here, and the wheels
are served only from NVIDIA's own index). The 1.2.1 names come from the nearest copies, and each one is in both an
older and a newer copy unless said otherwise:
- S: tensorrt_llm/sampling_params.py @ b35ac1b64368513d215c57d2ed01d62d910df8da (version.py: 1.2.0rc2), line numbers;
- A: tensorrt_llm/llmapi/llm_args.py, a late-2025 copy (TorchLlmArgs, KvCacheConfig, CudaGraphConfig: pydantic models
  with extra="forbid"; LLM(**kwargs) refuses any other name with "LLM got invalid argument");
- L: tensorrt_llm/llmapi/llm.py @ 4c05a74891e4df8066f08ed4ce14b0972abe4e25 (~1.1) and a 1.3/1.4 copy: generate_async;
- R: tensorrt_llm/executor/result.py @ a678b91aafbeff265cd0b764abb59d7def624ac2 (~1.1) and a 2026 copy: results.
The 1.4 differences come from 1.4.0rc4's documentation (D: features/sampling.html, the TorchLlmArgs, KvCacheConfig
and sampling_params module pages) and the nearest main-branch copy before it, C1 =
1f064c467a211b4168555ca06bb9b801c64eae20 (llmapi/llm_args.py, llmapi/llm.py, executor/result.py and
executor/params/sampling.py, where sampling_params.py moved; line numbers of the last, approximate), with the
TorchSampler modules of _torch/pyexecutor/sampler/ (P: penalties.py @ 0a0ceb0c3f403ef89ccbd8d5aabd4ee92298167d).
LoRA (the same names in the copies read for both releases):
- H: tensorrt_llm/lora_helper.py @ 037d4ba10931fbb9777d52fba06a9aef4b41acdd: `@dataclass class LoraConfig`; C1's
  llm_args.py imports LoraConfig from tensorrt_llm.lora_helper (TensorRT-LLM's docs/source/features/lora.md
  @ 050db34bb1eee1013388d225b9898b39edea6870 passes `LLM(model=..., lora_config=LoraConfig(lora_dir=[...],
  max_lora_rank=..., max_loras=..., max_cpu_loras=...))` and `LoRARequest(name, id, path)` on the PyTorch backend);
- Q: tensorrt_llm/executor/request.py, C1 and a copy with cache_salt_id (before 1.4's DEFAULT_REQUEST_PRIORITY):
  `@dataclass(slots=True) class LoRARequest`; tensorrt_llm.executor exports it (C1's llmapi/__init__.py imports it
  from there);
- X: tensorrt_llm/_torch/pyexecutor/_util.py and py_executor_creator.py, several copies: with one lora_dir the
  adapter's config is read (load_torch_lora / load_torch_hf_lora), with more `lora_target_modules` must name at least
  one module ("Expecting at least one lora target module") and trtllm_modules_to_hf_modules defaults to H's
  get_default_trtllm_modules_to_hf_modules.
"""

import os

RELEASE = os.environ.get("TRITONLLM_STANDIN_RELEASE", "1.2.1")
if RELEASE not in ("1.2.1", "1.4"):
    raise ImportError(f"TRITONLLM_STANDIN_RELEASE={RELEASE}: the stand-in is of 1.2.1 or 1.4")
VERSION = {"1.2.1": "1.2.1", "1.4": "1.4.0rc4"}[RELEASE]

# S:204-273, `@dataclass(slots=True, kw_only=True) class SamplingParams` (S:112-113), in order.
SAMPLING_PARAMS_FIELDS = (
    "end_id", "pad_id", "max_tokens", "bad", "bad_token_ids", "stop", "stop_token_ids", "include_stop_str_in_output",
    "embedding_bias", "logits_processor", "apply_batched_logits_processor", "n", "best_of", "use_beam_search",
    "top_k", "top_p", "top_p_min", "top_p_reset_ids", "top_p_decay", "seed", "temperature", "min_tokens",
    "beam_search_diversity_rate", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "prompt_ignore_length",  # new in 1.2 (TensorRT-LLM PR #8127): in S, not in the ~1.1 copies
    "length_penalty", "early_stopping", "no_repeat_ngram_size", "min_p", "beam_width_array", "logprobs",
    "prompt_logprobs", "return_context_logits", "return_generation_logits", "exclude_input_from_output",
    "return_encoder_output", "return_perf_metrics", "additional_model_outputs", "lookahead_config", "guided_decoding",
    "ignore_eos", "detokenize", "add_special_tokens", "truncate_prompt_tokens", "skip_special_tokens",
    "spaces_between_special_tokens",
)  # fmt: skip
# S:14-30, `@dataclass(slots=True, kw_only=True) class GuidedDecodingParams`; S:32-37: one guide per request.
GUIDED_DECODING_FIELDS = ("json", "regex", "grammar", "json_object", "structural_tag")
# S:49-66: `class LogitsProcessor(ABC)`, abstract `__call__(self, req_id, logits, token_ids, stream_ptr, client_id)`.
LOGITS_PROCESSOR_CALL = ("req_id", "logits", "token_ids", "stream_ptr", "client_id")
# L: `generate_async(self, inputs, sampling_params=None, lora_request=None, prompt_adapter_request=None,
# streaming=False, kv_cache_retention_config=None, disaggregated_params=None, _postproc_params=None,
# scheduling_params=None, cache_salt=None)`; the 1.3/1.4 copy adds trace_headers, conversation_params and priority.
GENERATE_ASYNC_PARAMETERS = (
    "inputs", "sampling_params", "lora_request", "prompt_adapter_request", "streaming", "kv_cache_retention_config",
    "disaggregated_params", "_postproc_params", "scheduling_params", "cache_salt",
)  # fmt: skip
# A: BaseLlmArgs and TorchLlmArgs fields, what LLM(**kwargs) takes (with `backend`, popped by _TorchLLM).
LLM_ARGS = (
    "model", "tokenizer", "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code", "tensor_parallel_size",
    "dtype", "revision", "tokenizer_revision", "pipeline_parallel_size", "context_parallel_size", "gpus_per_node",
    "moe_cluster_parallel_size", "moe_tensor_parallel_size", "moe_expert_parallel_size", "enable_attention_dp",
    "enable_lora", "lora_config", "kv_cache_config", "enable_chunked_prefill", "guided_decoding_backend",
    "batched_logits_processor", "iter_stats_max_iterations", "request_stats_max_iterations", "peft_cache_config",
    "scheduler_config", "cache_transceiver_config", "speculative_config", "max_batch_size", "max_input_len",
    "max_seq_len", "max_beam_width", "max_num_tokens", "gather_generation_logits", "num_postprocess_workers",
    "postprocess_tokenizer_dir", "reasoning_parser", "backend", "return_perf_metrics", "orchestrator_type",
    "garbage_collection_gen0_threshold", "cuda_graph_config", "attention_dp_config", "disable_overlap_scheduler",
    "moe_config", "attn_backend", "sampler_type", "enable_iter_perf_stats", "enable_iter_req_stats",
    "print_iter_log", "perf_metrics_max_requests", "batch_wait_timeout_ms", "batch_wait_timeout_iters",
    "batch_wait_max_tokens_ratio", "torch_compile_config", "enable_autotuner", "load_format", "enable_min_latency",
    "stream_interval", "force_dynamic_quantization", "allreduce_strategy", "checkpoint_loader", "checkpoint_format",
    "kv_connector_config", "mm_encoder_only", "ray_worker_extension_cls",
)  # fmt: skip
# A: KvCacheConfig (free_gpu_memory_fraction 0.9 by default, 0 <= v <= 1; tokens_per_block 32).
KV_CACHE_CONFIG_FIELDS = (
    "enable_block_reuse", "max_tokens", "max_attention_window", "sink_token_length", "free_gpu_memory_fraction",
    "host_cache_size", "onboard_blocks", "cross_kv_cache_fraction", "secondary_offload_min_priority",
    "event_buffer_max_size", "attention_dp_events_gather_period_ms", "enable_partial_reuse", "copy_on_partial_reuse",
    "use_uvm", "max_gpu_total_bytes", "dtype", "mamba_ssm_cache_dtype", "tokens_per_block",
)  # fmt: skip
# A: CudaGraphConfig; TorchLlmArgs.cuda_graph_config defaults to CudaGraphConfig() (on), None turns graphs off.
CUDA_GRAPH_CONFIG_FIELDS = ("batch_sizes", "max_batch_size", "enable_padding")
GUIDED_DECODING_BACKENDS = ("xgrammar", "llguidance")
# R: CompletionOutput's fields, and its properties token_ids_diff / logprobs_diff (the step's new part) and length.
COMPLETION_OUTPUT_FIELDS = (
    "index", "text", "token_ids", "cumulative_logprob", "logprobs", "prompt_logprobs", "finish_reason",
    "stop_reason", "generation_logits", "additional_context_outputs", "additional_generation_outputs",
    "disaggregated_params", "request_perf_metrics",
)  # fmt: skip
COMPLETION_OUTPUT_PROPERTIES = ("length", "text_diff", "token_ids_diff", "logprobs_diff")
FINISH_REASONS = ("stop", "length", "timeout", "cancelled")  # R: CompletionOutput.finish_reason's Literal
# R: `@dataclass(slots=True) class Logprob: logprob: float; rank: Optional[int] = None`;
# TokenLogprobs = list[dict[int, Logprob]]. RequestPerfMetrics (bindings): kv_cache_metrics.num_reused_blocks.
LOGPROB_FIELDS = ("logprob", "rank")
# H: LoraConfig's fields, in order (lora_ckpt_source "hf" or "nemo", checked in __post_init__).
LORA_CONFIG_FIELDS = (
    "lora_dir", "lora_ckpt_source", "max_lora_rank", "lora_target_modules", "trtllm_modules_to_hf_modules",
    "max_loras", "max_cpu_loras", "swap_gate_up_proj",
)  # fmt: skip
LORA_CHECKPOINT_SOURCES = ("hf", "nemo")
# Q: LoRARequest's fields, in order; the copy before 1.4 refuses a lora_path that does not exist.
LORA_REQUEST_FIELDS = ("lora_name", "lora_int_id", "lora_path", "lora_ckpt_source")
LORA_PATH_MUST_EXIST = True
# H: get_default_trtllm_modules_to_hf_modules' keys, the LoRA module names lora_target_modules takes.
LORA_MODULES = (
    "attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate", "mlp_gate_up",
    "moe_h_to_4h", "moe_4h_to_h", "moe_gate", "moe_router",
)  # fmt: skip

# ------------------------------------------------------------------ where 1.4 differs

# sampler_type: 1.2.1 (A) takes TRTLLMSampler, TorchSampler or auto (TorchSampler); 1.4 runs TorchSampler only and
# takes auto or TorchSampler, ignored, and refuses TRTLLMSampler (D: sampling.html "General usage"; PRs #18232, #18513).
SAMPLER_TYPES = ("TRTLLMSampler", "TorchSampler", "auto")
DEFAULT_SAMPLER = "TorchSampler"  # auto's, on both
# logprobs=0: 1.2.1's _validate keeps 0, which return_log_probs = bool(logprobs) reads as none (S:333, S:485); 1.4
# returns the sampled token's log probability alone (C1 sampling.py ~248; D).
LOGPROBS_ZERO_IS_NONE = True
# Presence and frequency: the C++ sampler subtracts them after the temperature; TorchSampler on 1.2.1 ignores them
# (TensorRT-LLM PR #16485 added them later); on 1.4 it subtracts them from the raw logits, before the temperature
# (P:~238-242, "bias -> penalty -> bans -> temperature -> sampling").
TORCH_SAMPLER_PENALTIES = "ignored"
LOGPROB_MODES: tuple[str, ...] = ()  # SamplingParams.logprobs_mode's LogprobMode values (C1 sampling.py 110-119)

if RELEASE == "1.4":
    # C1 sampling.py ~185-369: the 1.2.1 fields in their order, with logprobs_mode after use_beam_search,
    # logprobs_simple_format and prompt_logprobs_simple_format after prompt_logprobs, thinking_token_budget after
    # guided_decoding.
    _fields = list(SAMPLING_PARAMS_FIELDS)
    _fields.insert(_fields.index("use_beam_search") + 1, "logprobs_mode")
    _at = _fields.index("prompt_logprobs") + 1
    _fields[_at:_at] = ["logprobs_simple_format", "prompt_logprobs_simple_format"]
    _fields.insert(_fields.index("guided_decoding") + 1, "thinking_token_budget")
    SAMPLING_PARAMS_FIELDS = tuple(_fields)
    # C1 llm.py `def generate_async(`: trace_headers, conversation_params and priority added.
    GENERATE_ASYNC_PARAMETERS = (
        "inputs", "sampling_params", "lora_request", "prompt_adapter_request", "streaming",
        "kv_cache_retention_config", "disaggregated_params", "trace_headers", "_postproc_params",
        "scheduling_params", "conversation_params", "cache_salt", "priority",
    )  # fmt: skip
    LLM_ARGS = (*LLM_ARGS, "generation_config")  # C1 llm_args.py: "trtllm" by default, the release's own defaults
    SAMPLER_TYPES = ("TorchSampler", "auto")
    LOGPROBS_ZERO_IS_NONE = False
    TORCH_SAMPLER_PENALTIES = "before the temperature"
    LOGPROB_MODES = ("raw", "processed")
    LORA_PATH_MUST_EXIST = False  # C1 request.py: LoRARequest checks lora_ckpt_source only
