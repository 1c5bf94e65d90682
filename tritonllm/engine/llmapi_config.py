"""The LLM API flavor's configuration: the build's options, resolved into `tensorrt_llm.LLM`'s keyword arguments.

TensorRT-LLM's LLM API (PyTorch backend, no engine build) loads the Hugging Face checkpoint itself. The build
writes the arguments beside the engine model as llm_api.json, plain JSON as NVIDIA's llmapi model.yaml holds them
(its "llm"), with the release and sampler they are for: the LLM's own argument model turns the nested dicts into its
config objects, so the file is what a reviewer checks against `tensorrt_llm/llmapi/llm_args.py` of that release
(docs/llmapi.md lists each name with its source).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
# A PEFT adapter's modules in TensorRT-LLM's LoRA module names: the inverse of the release's default mapping
# (tensorrt_llm/lora_helper.py, get_default_trtllm_modules_to_hf_modules), dense layers only. With more than one
# adapter folder the PyTorch executor reads no adapter's config for them: LoraConfig.lora_target_modules must name
# them (tests/standins/tensorrt_llm/surface.py has the sources).
TRTLLM_LORA_MODULES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h",
    "down_proj": "mlp_4h_to_h",
    "up_proj": "mlp_gate",
    "gate_up_proj": "mlp_gate_up",
}
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class LlmApiAdapter:
    """A LoRA adapter of --lora NAME=PATH for the LLM API: a PEFT folder, which TensorRT-LLM loads itself."""

    name: str
    task_id: int  # NVIDIA's lora_task_id, and the LoRARequest's lora_int_id
    path: str  # the PEFT folder (LoRARequest.lora_path, and one of LoraConfig.lora_dir)
    rank: int  # the largest rank of its layers (PEFT's r, and rank_pattern's)
    modules: tuple[str, ...]  # its target modules, in TensorRT-LLM's names

    def as_json(self) -> dict:
        """How llm_api.json lists it (the engine's AdapterTable is made from these)."""
        return {"name": self.name, "task_id": self.task_id, "path": self.path}


def llm_api_adapter(name: str, folder: Path, task_id: int) -> LlmApiAdapter:
    """The adapter of `--lora name=folder`, read from its PEFT config; ConfigError naming it for what cannot be
    passed to TensorRT-LLM's LoraConfig (no folder, no config or weights, target modules it has no name for)."""
    spec = f"--lora {name}={folder}"
    if not folder.is_dir():
        raise ConfigError(f"{spec}: no such folder (a PEFT adapter folder, as PEFT writes it)")
    config_file = folder / PEFT_CONFIG
    if not config_file.is_file() or not any((folder / weights).is_file() for weights in PEFT_WEIGHTS):
        raise ConfigError(f"{spec}: expected a PEFT adapter folder with {PEFT_CONFIG} and {PEFT_WEIGHTS[0]}")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{spec}: peft_type {config['peft_type']}; only LORA adapters are served")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets:
        raise ConfigError(
            f"{spec}: target_modules {targets!r}: a list of module names is needed (LoraConfig.lora_target_modules)"
        )
    unknown = sorted(set(targets) - TRTLLM_LORA_MODULES.keys())
    if unknown:
        raise ConfigError(
            f"{spec}: target module {unknown[0]} has no TensorRT-LLM LoRA module name; it takes "
            f"{', '.join(TRTLLM_LORA_MODULES)}"
        )
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(rank, int) and rank > 0 for rank in ranks):
        raise ConfigError(f"{spec}: r (and rank_pattern) must be positive integers, got {ranks}")
    modules = tuple(sorted({TRTLLM_LORA_MODULES[target] for target in targets}))
    return LlmApiAdapter(name, task_id, str(folder.resolve()), max(ranks), modules)


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
    lora_adapters: tuple[LlmApiAdapter, ...] = ()  # --lora NAME=PATH, task ids 1, 2, ... in order
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
        settings = {"release": self.llm_api_release, "sampler": self.sampler, "llm": self.llm_kwargs()}
        if self.lora_adapters:
            settings["lora_adapters"] = [adapter.as_json() for adapter in self.lora_adapters]
        return settings

    def lora_config(self) -> dict | None:
        """`tensorrt_llm.lora_helper.LoraConfig`'s arguments for the adapters (the engine makes the object: the LLM's
        argument model takes a LoraConfig): every folder, the union of their modules, the largest rank, and room
        for all of them on the GPU and the host."""
        if not self.lora_adapters:
            return None
        return {
            "lora_dir": [adapter.path for adapter in self.lora_adapters],
            "lora_target_modules": sorted({m for adapter in self.lora_adapters for m in adapter.modules}),
            "max_lora_rank": max(adapter.rank for adapter in self.lora_adapters),
            "max_loras": len(self.lora_adapters),
            "max_cpu_loras": len(self.lora_adapters),
        }

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
            # LoRA on the PyTorch backend: lora_config alone, as TensorRT-LLM's LoRA guide passes it (no enable_lora).
            **({"lora_config": self.lora_config()} if self.lora_adapters else {}),
        }
