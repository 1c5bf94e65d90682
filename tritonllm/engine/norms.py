"""A model's RMSNorm layers as torch's one-kernel `rms_norm` instead of transformers' elementwise steps.

transformers writes RMSNorm as ~8 elementwise operations (casts, square, mean, add, rsqrt, two products),
each a kernel launch and a pass over the activations, a large share of the kernels a batch-1 decode step
runs on a GPU (docs/performance.md). torch's `rms_norm` does it in one.
A layer is swapped only when its class computes what `rms_norm` does, checked on a float32 copy with
random weights: variants such as Gemma's `(1 + weight)` scaling keep their own code.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn.functional as F


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Makes each RMSNorm layer of `model` whose class computes torch's `rms_norm` call it; returns how many."""
    verdicts: dict[type, bool] = {}
    fused = 0
    for module in model.modules():
        if not type(module).__name__.endswith("RMSNorm") or _epsilon(module) is None:
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            continue
        if type(module) not in verdicts:
            verdicts[type(module)] = computes_rms_norm(module)
        if verdicts[type(module)]:
            module.rms_norm_eps = _epsilon(module)  # read once, not at every step
            module.forward = types.MethodType(_rms_norm_forward, module)
            fused += 1
    return fused


def computes_rms_norm(module: torch.nn.Module) -> bool:
    """Whether the layer's own forward equals torch's `rms_norm`, on a float32 copy with random weights."""
    probe = copy.deepcopy(module).float().cpu()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=generator))
        x = torch.randn(3, probe.weight.shape[0], generator=generator)
        try:
            expected = probe(x)
        except Exception:  # a forward that takes more than the hidden states is not a plain RMSNorm
            return False
        actual = F.rms_norm(x, probe.weight.shape, probe.weight, _epsilon(probe))
    return expected.shape == actual.shape and torch.allclose(expected, actual, rtol=1e-5, atol=1e-6)


def _epsilon(module: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.rms_norm_eps)
