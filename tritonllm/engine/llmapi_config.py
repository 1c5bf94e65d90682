"""The LLM API flavor's configuration: the build's options, resolved into `tensorrt_llm.LLM`'s keyword arguments.

TensorRT-LLM's LLM API (PyTorch backend, no engine build) loads the Hugging Face checkpoint itself. The build
writes the arguments beside the engine model as llm_api.json, plain JSON as NVIDIA's llmapi model.yaml holds them
(its "llm"), with the release and sampler they are for: the LLM's own argument model turns the nested dicts into its
config objects, so the file is what a reviewer checks against `tensorrt_llm/llmapi/llm_args.py` of that release
(docs/llmapi.md lists each name with its source).
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonllm.errors import ConfigError
from tritonllm.options import option
from tritonllm.versions import DEFAULT_LLM_API_RELEASE, LLM_API_RELEASES

LLM_API_CONFIG_FILE = "llm_api.json"  # beside the engine model, as ENGINE_CONFIG_FILE is for the portable engine
LLM_API_DTYPES = ("auto", "float16", "bfloat16", "float32")
# KvCacheConfig.dtype: "auto" keeps the checkpoint's (a ModelOpt checkpoint may say fp8); fp8 quantizes the cache.
KV_CACHE_DTYPES = {"none": "auto", "fp8": "fp8"}
TOKENS_PER_BLOCK = 32  # the LLM API's KV cache block (KvCacheConfig.tokens_per_block's default), for the reuse counts
TORCH_SAMPLER = "TorchSampler"
SAMPLERS = ("TRTLLMSampler", TORCH_SAMPLER, "auto")
# The samplers each release runs, its default first (tests/standins/tensorrt_llm/surface.py has the sources): 1.4
# removed the C++ sampler (TensorRT-LLM PRs #18232 and #18513; its sampling docs: TRTLLMSampler is refused).
RELEASE_SAMPLERS = {"1.2.1": ("TRTLLMSampler", TORCH_SAMPLER), "1.4": (TORCH_SAMPLER,)}


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
    llm_api_release: str = option(
        DEFAULT_LLM_API_RELEASE,
        "LLM API flavor: the TensorRT-LLM release it runs on (tritonllm/versions.py locks each with its image): 1.2.1, "
        "in Triton 26.07's TensorRT-LLM image; 1.4 (1.4.0rc4), in NVIDIA's TensorRT-LLM release image with the "
        "nvidia-pytriton wheel's tritonserver",
        choices=tuple(LLM_API_RELEASES),
    )
    llm_api_sampler: str | None = option(
        None,
        "LLM API flavor: the sampler (TorchLlmArgs.sampler_type); unset: the release's. TRTLLMSampler, 1.2.1's "
        "default: TensorRT-LLM's C++ sampling layers, which apply the penalties, seeds and minimum length as its "
        "engine flavor does. TorchSampler: 1.4's only sampler; on 1.2.1 it ignores penalties, which are then refused. "
        "auto: TensorRT-LLM's choice, TorchSampler",
        choices=SAMPLERS,
    )
    llm_api_cuda_graphs: bool = option(
        True,
        "LLM API flavor: run decoding steps of up to --max-batch-size requests as CUDA graphs "
        "(cuda_graph_config; off: none captured)",
    )

    @property
    def sampler(self) -> str:
        """The sampler that runs: the one asked for, else the release's; auto is TensorRT-LLM's choice, TorchSampler."""
        asked = self.llm_api_sampler or RELEASE_SAMPLERS[self.llm_api_release][0]
        return TORCH_SAMPLER if asked == "auto" else asked

    def check(self, max_input_len: int) -> None:
        if self.sampler not in RELEASE_SAMPLERS[self.llm_api_release]:
            raise ConfigError(
                f"--llm-api-sampler {self.llm_api_sampler}: TensorRT-LLM {self.llm_api_release} has "
                f"{', '.join(RELEASE_SAMPLERS[self.llm_api_release])} only"
            )
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

    def engine_settings(self) -> dict:
        """llm_api.json: the release and sampler the engine maps requests for (tritonllm/engine/llmapi_params.py),
        and `tensorrt_llm.LLM`'s keyword arguments."""
        return {"release": self.llm_api_release, "sampler": self.sampler, "llm": self.llm_kwargs()}

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
            # 1.4 has TorchSampler only, and refuses the argument's C++ value: it is sent where there is a choice.
            **({"sampler_type": self.sampler} if len(RELEASE_SAMPLERS[self.llm_api_release]) > 1 else {}),
            # The grammar engine TensorRT-LLM compiles guides with (the engine flavor's too): guided requests need it.
            "guided_decoding_backend": "xgrammar",
            # Per-request KV cache counts and times, which return_perf_metrics asks for.
            "return_perf_metrics": True,
        }
