"""Sibling projections that read the same input (q/k/v, gate/up) as one matrix product.

transformers runs a decoder layer's query, key and value projections as three products and an MLP's
gate and up projections as two, each a kernel over the same activations. At batch 1 on a GPU each
product is a matrix-vector one bound by its launch and the tail of its weight read, and the key and
value ones (512 rows for a 7B model of 3,584 columns) are too small to fill the device; one product
over the stacked weights reads the same bytes in fewer, larger kernels.

The layer's own forward is kept: each projection becomes a view of the stacked product. The first of a
group to be called with an input computes the product for all of them; the others return their part
when called with the very same tensor, and compute their own product otherwise. So a forward that
calls them in another order, or on other inputs, gets the same numbers, only without the saving.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

# Groups of a module's children that transformers' decoders call on one input, in that order, and the name
# the stacked weights take.
GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class StackedLinear(torch.nn.Module):
    """The stacked weights of a group, and the product of the input it last saw until its last part used it."""

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
        has_bias = linears[0].bias is not None
        self.bias = (
            torch.nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False) if has_bias else None
        )
        ends = list(itertools.accumulate(m.out_features for m in linears))
        self.bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        # (input, stacked product) of the last call, in a list: setting module attributes at every call goes
        # through nn.Module.__setattr__, a measurable share of a small model's CPU decode step.
        self.last: list[torch.Tensor | None] = [None, None]

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        start, end = self.bounds[index]
        if torch.compiler.is_compiling():  # dynamo need not trace the cache; the compiler fuses on its own
            return F.linear(x, self.weight[start:end], None if self.bias is None else self.bias[start:end])
        last = self.last
        if last[0] is not x:
            last[0], last[1] = x, F.linear(x, self.weight, self.bias)
        out = last[1][..., start:end]
        if index == len(self.bounds) - 1:  # the group is complete: hold no activations between layers
            last[0] = last[1] = None
        return out


class ProjectionPart(torch.nn.Module):
    """Stands in for one projection of a group: its slice of the stacked product."""

    def __init__(self, stacked: StackedLinear, index: int) -> None:
        super().__init__()
        self._stacked = (stacked,)  # a tuple: the stacked weights are registered once, on the parent module
        self.index = index
        start, end = stacked.bounds[index]
        self.in_features, self.out_features = stacked.weight.shape[1], end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._stacked[0].part(self.index, x)


def merge_projections(model: torch.nn.Module) -> int:
    """Stacks each group of GROUPS found as plain Linear children with one input size; returns how many."""
    merged = 0
    for module in list(model.modules()):
        for stacked_name, names in GROUPS.items():
            linears = [getattr(module, name, None) for name in names]
            if not all(type(m) is torch.nn.Linear for m in linears):
                continue
            if len({m.in_features for m in linears}) > 1 or len({m.bias is None for m in linears}) > 1:
                continue
            stacked = StackedLinear(linears)
            module.add_module(stacked_name, stacked)
            for index, name in enumerate(names):
                setattr(module, name, ProjectionPart(stacked, index))  # frees the original weights
            merged += 1
    return merged
