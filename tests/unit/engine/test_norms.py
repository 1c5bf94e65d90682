"""RMSNorm layers swapped for torch's rms_norm only where they compute the same (tritonllm/engine/norms.py)."""

import torch
from transformers import AutoModelForCausalLM

from tritonllm.engine.norms import computes_rms_norm, fuse_rms_norms


class OnePlusWeightRMSNorm(torch.nn.Module):
    """Gemma's variant: scales by (1 + weight), so torch's rms_norm would compute something else."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(size))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class GatedRMSNorm(OnePlusWeightRMSNorm):
    """Takes a second input: not a plain RMSNorm layer."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return super().forward(x * gate)


def test_the_models_norms_run_as_rms_norm_with_the_same_logits(manifest):
    model = AutoModelForCausalLM.from_pretrained(manifest["model_dir"], dtype=torch.float32).eval()
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 2]])
    with torch.no_grad():
        before = model(ids).logits
        assert fuse_rms_norms(model) == 2 * model.config.num_hidden_layers + 1  # two per layer and the final one
        after = model(ids).logits
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert all(m.forward.__func__.__module__ == "tritonllm.engine.norms" for m in norms)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_norms_that_compute_something_else_keep_their_code():
    model = torch.nn.Sequential(OnePlusWeightRMSNorm(8), GatedRMSNorm(8))
    assert not computes_rms_norm(model[0]) and not computes_rms_norm(model[1])
    assert fuse_rms_norms(model) == 0
    assert all("forward" not in vars(m) for m in model)  # no instance-level replacement
