"""Where the real TensorRT-LLM is installed (NVIDIA's image of a release in tritonllm/versions.py LLM_API_RELEASES):
every name the LLM API flavor uses for that release exists there, as the stand-in (tests/standins/tensorrt_llm)
says. Elsewhere these tests are skipped: the stand-in's names are then only checked against the sources recorded in
tests/standins/tensorrt_llm/surface.py (tests/unit/engine/test_llmapi.py).

In the image: python -m pytest tests/unit/engine/test_llmapi_release.py
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.unit.engine.test_llmapi import every_control
from tritonllm.engine.api import GenerationRequest, Guide, Penalties
from tritonllm.engine.llmapi_config import LlmApiConfig
from tritonllm.engine.llmapi_params import SAMPLER_RULES, guided_decoding_kwargs, sampling_kwargs
from tritonllm.protocol import GUIDE_TYPES
from tritonllm.versions import LLM_API_RELEASES


@pytest.fixture(scope="module")
def trt():
    module = pytest.importorskip("tensorrt_llm", reason="the real TensorRT-LLM is not installed here")
    if (ROOT / "tests" / "standins") in Path(module.__file__).parents:
        pytest.skip("tensorrt_llm here is the project's stand-in")
    return module


@pytest.fixture(scope="module")
def config(trt) -> LlmApiConfig:
    """The default build for the release installed here."""
    (release,) = [name for name, lock in LLM_API_RELEASES.items() if lock.trtllm == trt.__version__] or [None]
    if release is None:
        pytest.fail(f"TensorRT-LLM {trt.__version__} is none of the releases in tritonllm/versions.py")
    return LlmApiConfig("/model", llm_api_release=release)


def field_names(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.model_fields)  # pydantic


def test_every_sampling_name_used_exists(trt, config):
    from tensorrt_llm.sampling_params import GuidedDecodingParams, LogitsProcessor

    rules = SAMPLER_RULES[config.llm_api_release, config.sampler]
    requests = [
        every_control(),
        GenerationRequest([1, 2], 4),
        every_control(penalties=Penalties(presence=0.5, count_prompt=False)),
    ]
    used = set().union(*(sampling_kwargs(r, rules) for r in requests)) | {"guided_decoding", "logits_processor"}
    if rules.logprobs_mode:
        from tensorrt_llm.sampling_params import LogprobMode

        used.add("logprobs_mode")
        assert LogprobMode.PROCESSED
    assert used <= field_names(trt.SamplingParams)
    guides = set().union(*(guided_decoding_kwargs(Guide(kind, "x")) for kind in GUIDE_TYPES))
    assert guides <= field_names(GuidedDecodingParams)
    assert list(inspect.signature(LogitsProcessor.__call__).parameters)[1:] == [
        "req_id", "logits", "token_ids", "stream_ptr", "client_id"
    ]  # fmt: skip


def test_every_llm_argument_used_exists(trt, config):
    from tensorrt_llm.llmapi.llm_args import CudaGraphConfig, KvCacheConfig, TorchLlmArgs

    kwargs = config.llm_kwargs()
    assert set(kwargs) - {"backend"} <= field_names(TorchLlmArgs)
    assert set(kwargs["kv_cache_config"]) <= field_names(KvCacheConfig)
    assert set(kwargs["cuda_graph_config"]) <= field_names(CudaGraphConfig)
    parameters = inspect.signature(trt.LLM.generate_async).parameters
    assert {"inputs", "sampling_params", "lora_request", "streaming"} <= set(parameters)


def test_the_results_have_the_fields_read(trt):
    from tensorrt_llm.executor.result import CompletionOutput, Logprob

    assert {"token_ids", "finish_reason", "request_perf_metrics", "logprobs"} <= field_names(CompletionOutput)
    assert all(isinstance(getattr(CompletionOutput, p), property) for p in ("token_ids_diff", "logprobs_diff"))
    assert {"logprob", "rank"} <= field_names(Logprob)
