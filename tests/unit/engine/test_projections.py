"""Sibling projections run as one stacked product, with the numbers they had (tritonllm/engine/projections.py)."""

import torch
from transformers import AutoModelForCausalLM

from tritonllm.engine.projections import merge_projections


class Attention(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8, bias=bias)
        self.k_proj = torch.nn.Linear(8, 4, bias=bias)
        self.v_proj = torch.nn.Linear(8, 4, bias=bias)


def test_the_models_projections_stack_with_the_same_logits(manifest):
    model = AutoModelForCausalLM.from_pretrained(manifest["model_dir"], dtype=torch.float32).eval()
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 2]])
    parameters = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        before = model(ids).logits
        assert merge_projections(model) == 2 * model.config.num_hidden_layers  # q/k/v and gate/up per layer
        after = model(ids).logits
    layer = dict(model.model.layers[0].named_parameters())
    assert "self_attn.qkv_proj.weight" in layer and "mlp.gate_up_proj.weight" in layer
    assert "self_attn.q_proj.weight" not in layer  # the separate weights are gone, not kept beside the stack
    assert sum(p.numel() for p in model.parameters()) == parameters
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_parts_called_out_of_order_or_on_other_inputs_give_their_own_projection():
    torch.manual_seed(0)
    module = Attention(bias=True)
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    expected = {name: getattr(module, name)(x).detach() for name in ("q_proj", "k_proj", "v_proj")}
    other = module.k_proj(y).detach()
    assert merge_projections(module) == 1
    with torch.no_grad():
        torch.testing.assert_close(module.v_proj(x), expected["v_proj"])  # the last part first
        torch.testing.assert_close(module.k_proj(y), other)  # another input: its own product
        torch.testing.assert_close(module.q_proj(x), expected["q_proj"])
        torch.testing.assert_close(module.k_proj(x), expected["k_proj"])  # the stacked product of q's call
        torch.testing.assert_close(module.v_proj(x), expected["v_proj"])
    assert module.qkv_proj.last == [None, None]  # released once the group's last part used it


def test_projections_of_other_shapes_or_kinds_stay_apart():
    mixed_bias = Attention(bias=True)
    mixed_bias.v_proj = torch.nn.Linear(8, 4, bias=False)
    other_input = Attention(bias=False)
    other_input.k_proj = torch.nn.Linear(6, 4, bias=False)
    assert merge_projections(torch.nn.Sequential(mixed_bias, other_input)) == 0
    assert type(mixed_bias.q_proj) is torch.nn.Linear and type(other_input.q_proj) is torch.nn.Linear
