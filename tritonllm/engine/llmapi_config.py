"""The LLM API flavor's configuration: the build's options, resolved into `tensorrt_llm.LLM`'s keyword arguments.

TensorRT-LLM's LLM API (PyTorch backend, no engine build) loads the Hugging Face checkpoint itself. The build
writes the arguments beside the engine model as llm_api.json, plain JSON as NVIDIA's llmapi model.yaml holds them:
the LLM's own argument model turns the nested dicts into its config objects, so the file is what a reviewer checks
against `tensorrt_llm/llmapi/llm_args.py` of the pinned release (docs/llmapi.md lists each name with its source).
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonllm.errors import ConfigError
from tritonllm.options import option

LLM_API_CONFIG_FILE = "llm_api.json"  # beside the engine model, as ENGINE_CONFIG_FILE is for the portable engine
LLM_API_DTYPES = ("auto", "float16", "bfloat16", "float32")
# KvCacheConfig.dtype: "auto" keeps the checkpoint's (a ModelOpt checkpoint may say fp8); fp8 quantizes the cache.
KV_CACHE_DTYPES = {"none": "auto", "fp8": "fp8"}
TOKENS_PER_BLOCK = 32  # the LLM API's KV cache block (KvCacheConfig.tokens_per_block's default), for the reuse counts


@dataclass(frozen=True)
class LlmApiConfig:
    """What the build decides for the LLM API engine; option fields are build flags (tritonllm/options.py), the
    rest come from the flags every flavor shares (--tp, --pp, --max-batch-size, --max-seq-len, --max-num-tokens,
    --kv-cache-free-gpu-mem-fraction, --kv-cache-quant, --dtype)."""

    model: str  # the Hugging Face folder: weights, config and tokenizer
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    max_seq_len: int = 4096
    dtype: str = "auto"
    free_gpu_memory_fraction: float = 0.85
    kv_cache_dtype: str = "auto"
    kv_cache_reuse: bool = option(
        True,
        "LLM API flavor: keep finished requests' KV cache blocks and start a later prompt with the same beginning "
        "from them (KvCacheConfig.enable_block_reuse)",
    )
    llm_api_sampler: str = option(
        "TRTLLMSampler",
        "LLM API flavor: the sampler (TorchLlmArgs.sampler_type): TRTLLMSampler, TensorRT-LLM's C++ sampling layers, "
        "which apply the penalties, seeds and minimum length as its engine flavor does; TorchSampler or auto "
        "(TensorRT-LLM's choice, TorchSampler), whose penalties and seeds are not known to be honoured in 1.2.1",
        choices=("TRTLLMSampler", "TorchSampler", "auto"),
    )
    llm_api_cuda_graphs: bool = option(
        True,
        "LLM API flavor: run decoding steps of up to --max-batch-size requests as CUDA graphs "
        "(cuda_graph_config; off: none captured)",
    )

    def check(self, max_input_len: int) -> None:
        if self.dtype not in LLM_API_DTYPES:
            raise ConfigError(f"--dtype {self.dtype}: the LLM API flavor takes {', '.join(LLM_API_DTYPES)}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError(f"--tp {self.tensor_parallel_size} --pp {self.pipeline_parallel_size}: both >= 1")
        if not 0 < self.free_gpu_memory_fraction <= 1:
            raise ConfigError(
                f"--kv-cache-free-gpu-mem-fraction must be in (0, 1], got {self.free_gpu_memory_fraction}"
            )
        if self.max_num_tokens < max_input_len:  # chunked prefill stays off: a longer prompt would not fit a step
            raise ConfigError(
                f"--max-num-tokens {self.max_num_tokens} is below the maximum input length {max_input_len}: a prompt "
                "is prefilled in one step; raise --max-num-tokens or lower --max-input-len"
            )

    def llm_kwargs(self) -> dict:
        """`tensorrt_llm.LLM(**kwargs)` for this configuration, as plain JSON values."""
        graphs = {"max_batch_size": self.max_batch_size, "enable_padding": True} if self.llm_api_cuda_graphs else None
        return {
            "model": self.model,
            "backend": "pytorch",
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "dtype": self.dtype,
            "max_batch_size": self.max_batch_size,
            "max_num_tokens": self.max_num_tokens,
            "max_seq_len": self.max_seq_len,
            "kv_cache_config": {
                "free_gpu_memory_fraction": self.free_gpu_memory_fraction,
                "enable_block_reuse": self.kv_cache_reuse,
                "dtype": self.kv_cache_dtype,
            },
            "cuda_graph_config": graphs,
            "sampler_type": self.llm_api_sampler,
            # The grammar engine TensorRT-LLM compiles guides with (the engine flavor's too): guided requests need it.
            "guided_decoding_backend": "xgrammar",
            # Per-request KV cache counts and times, which return_perf_metrics asks for.
            "return_perf_metrics": True,
        }
