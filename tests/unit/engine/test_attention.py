"""The varlen attention adapter (tritonllm/engine/attention.py) as transformers' batching calls it.

Its FlashAttention kernel runs on CUDA only; here a reference kernel written with SDPA, one request at a
time, stands in for it, so these tests check what the adapter and the engine's switch do: shapes, heads,
scale and the boundaries the batching manager passes. benchmarks/gpu_bench.py checks the kernel on the GPU.
"""

import threading

import pytest
import torch

from benchmarks.attention_reference import reference_kernel
from tritonllm.engine import attention
from tritonllm.engine.api import EngineConfig, GenerationRequest
from tritonllm.engine.attention import VARLEN
from tritonllm.engine.portable import PortableEngine


def test_adapter_matches_per_request_attention(monkeypatch):
    monkeypatch.setattr(attention, "_kernel", reference_kernel)
    torch.manual_seed(0)
    heads, kv_heads, dim = 6, 2, 16
    q_lens, k_lens = [3, 1, 5], [7, 4, 5]  # a prefill chunk after a cache, a decode step, a fresh prompt
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()])
    query = torch.randn(1, heads, sum(q_lens), dim)
    key, value = torch.randn(2, 1, kv_heads, sum(k_lens), dim)
    out, weights = attention.varlen_attention(
        None,
        query,
        key,
        value,
        None,
        scaling=0.3,
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=5,
        max_length_k=7,
    )
    assert weights is None and out.shape == (1, sum(q_lens), heads, dim)
    # The decode step of request 1: its one query sees its 4 keys, in every head of its group.
    q1 = query[0, :, 3]  # [heads, dim]
    k1, v1 = key[0, :, 7:11].repeat_interleave(3, dim=0), value[0, :, 7:11].repeat_interleave(3, dim=0)
    expected = ((q1.unsqueeze(1) @ k1.transpose(1, 2) * 0.3).softmax(-1) @ v1).squeeze(1)
    torch.testing.assert_close(out[0, 3], expected)


def test_adapter_needs_batching_boundaries():
    with pytest.raises(ValueError, match="continuous batching"):
        attention.varlen_attention(None, *torch.zeros(3, 1, 2, 4, 8), None)


def test_cpu_is_refused_with_what_to_do():
    assert "--attention sdpa" in attention.unavailable_reason("cpu")
    with pytest.raises(ValueError, match="varlen"):
        PortableEngine(EngineConfig("unused", attention=VARLEN))


def test_varlen_needs_torch_with_scale_and_window(monkeypatch):
    """torch 2.10's varlen_attn takes no scale (models choose their own): CUDA then falls back to SDPA."""
    import torch.nn.attention.varlen as varlen

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None): ...

    attention._varlen_attn.cache_clear()
    try:
        assert attention.unavailable_reason("cuda") is None  # this environment's torch
        monkeypatch.setattr(varlen, "varlen_attn", torch_2_10)
        attention._varlen_attn.cache_clear()
        assert "torch 2.11 or later" in attention.unavailable_reason("cuda")
    finally:
        monkeypatch.undo()
        attention._varlen_attn.cache_clear()


def test_batched_engine_on_varlen_equals_sdpa(manifest, tokenizer, monkeypatch):
    """The engine switched to the adapter gives the SDPA engine's greedy tokens for requests that share steps."""
    calls = []

    def counted(*args):
        calls.append(args[3].numel() - 1)  # requests in the step
        return reference_kernel(*args)

    monkeypatch.setattr(attention, "_kernel", counted)
    monkeypatch.setattr(attention, "unavailable_reason", lambda device, dtype: None)
    prompts = [tokenizer.encode(f"List {n} fruits, one per line:") for n in range(2, 8)]
    results = {}
    for name in ("sdpa", VARLEN):
        config = EngineConfig(manifest["model_dir"], dtype=manifest["dtype"], max_batch_size=4, attention=name)
        engine = PortableEngine(config)
        try:
            results[name] = run_together(engine, prompts, 10)
        finally:
            engine.shutdown()
    assert max(calls) == 4  # steps of 4 requests ran through the adapter
    assert all(len(tokens) == 10 for tokens in results[VARLEN])
    assert results[VARLEN] == results["sdpa"]


def run_together(engine, prompts, max_new_tokens):
    """The tokens of each prompt, all submitted at once: with more prompts than slots, prefills join decodes."""
    outputs = [[] for _ in prompts]
    finished = [threading.Event() for _ in prompts]

    def collector(i):
        def emit(emission):
            outputs[i].extend(emission.token_ids)
            if emission.final:
                finished[i].set()

        return emit

    for i, ids in enumerate(prompts):
        engine.submit(GenerationRequest(ids, max_new_tokens), collector(i))
    assert all(event.wait(120) for event in finished)
    return outputs
