"""Variable-length attention for transformers' continuous batching, from torch's own FlashAttention kernels.

The batching manager runs every request of a step as one packed sequence. With SDPA that needs a mask of
(step tokens) x (all the batch's cached tokens) and the key/value heads repeated for grouped-query
attention, so a step's attention grows with the square of the batch (docs/performance.md). Its flash path
takes each request's boundaries (`cu_seq_lens_*`) instead, but calls the flash-attn package, which
publishes no wheels for current torch.
torch ships the same FlashAttention-2 kernel as `torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16);
`varlen_attention` adapts it to transformers' attention interface.

transformers accepts only "sdpa", "paged|eager" and flash names for continuous batching, and treats a
flash name as a kernel to import, so the engine creates its batching manager with SDPA and switches the
model to `NAME` before the manager allocates its step buffers: those then carry boundaries, no masks.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

VARLEN = "varlen"  # the engine's `attention` value (build_engines.py --attention varlen)
NAME = "tritonllm_varlen"  # the implementation's name in transformers' attention interface


@functools.cache
def _varlen_attn() -> tuple[Callable, dict] | None:
    """torch's varlen_attn and the options it needs here, or None in releases without it or without the
    scale and window arguments (torch 2.10's has neither: models choose their own scale)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if not {"scale", "window_size"} <= parameters.keys():
        return None
    # Grouped-query attention (fewer key/value heads) is native to the kernel; later torch releases ask for
    # it explicitly.
    options = {"enable_gqa": True} if "enable_gqa" in parameters else {}
    return varlen_attn, options


def unavailable_reason(device: str, dtype: str = "bfloat16") -> str | None:
    """Why `NAME` cannot run on `device` with weights of `dtype` here, or None when it can."""
    if not device.startswith("cuda"):
        return "varlen attention runs on CUDA GPUs only (FlashAttention kernels); use --attention sdpa on CPU"
    if dtype not in ("bfloat16", "float16"):
        return f"varlen attention takes bfloat16 or float16 only (FlashAttention), not {dtype}; use --attention sdpa"
    if _varlen_attn() is None:
        return (
            f"torch {torch.__version__} lacks torch.nn.attention.varlen.varlen_attn with scale and window "
            "arguments (torch 2.11 or later has it); use --attention sdpa or upgrade torch"
        )
    return None


def register() -> str:
    """Makes `NAME` an attention implementation transformers' models accept; returns it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    return NAME


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, step tokens, head dim]
    key: torch.Tensor,  # [1, kv heads, cached + step tokens, head dim], as the paged cache returns them
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """Causal attention of each request's new tokens over its cached ones, aligned at the end (a request's
    last query sees all its keys). Returns [1, step tokens, heads, head dim], as transformers expects."""
    if cu_seq_lens_q is None or cu_seq_lens_k is None or max_length_q is None or max_length_k is None:
        raise ValueError(f"attention '{NAME}' runs only under continuous batching: no sequence boundaries were given")
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head dim]
    window = (-1 if sliding_window is None else sliding_window - 1, 0)  # (-1, 0): causal
    out = _kernel(
        q,
        k,
        v,
        cu_seq_lens_q.to(torch.int32),
        cu_seq_lens_k.to(torch.int32),
        max_length_q,
        max_length_k,
        scaling,
        window,
    )
    return out.unsqueeze(0), None


def _kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None,
    window: tuple[int, int],
) -> torch.Tensor:
    resolved = _varlen_attn()
    if resolved is None:
        raise RuntimeError(unavailable_reason("cuda"))
    varlen_attn, options = resolved
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window, **options)
