"""Per-request SDPA: the reference the varlen attention kernel is checked against (tests, GPU benchmark)."""

from __future__ import annotations

import torch


def reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
    """Each request's queries attend causally to its keys, the last query to all of them."""
    assert window == (-1, 0)
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())
    out = torch.zeros_like(q)  # rows past the last boundary (padding) are not attended
    groups = q.size(1) // k.size(1)
    for i in range(cu_q.numel() - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        if qe == qs:
            continue
        allowed = torch.arange(ke - ks)[None, :] <= torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)
        heads = [t.repeat_interleave(g, dim=1).transpose(0, 1) for t, g in ((k[ks:ke], groups), (v[ks:ke], groups))]
        query = q[qs:qe].transpose(0, 1)
        out[qs:qe] = torch.nn.functional.scaled_dot_product_attention(
            query, *heads, attn_mask=allowed, scale=scale
        ).transpose(0, 1)
    return out
