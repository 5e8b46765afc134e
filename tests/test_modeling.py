"""Building blocks of the drafter against their defining formulas (DESIGN.md section 4)."""

from __future__ import annotations

import pytest
import torch

from dflash2_hf.modeling_dflash2 import GroupedDynamicCausalConv


def _reference_mix(conv: GroupedDynamicCausalConv, x: torch.Tensor, side: int) -> torch.Tensor:
    """``x'_t = sum_j (K_side[j] + D_side,t[j]) * x_{t-j}``, position by position, zero before the block start."""
    n, length, hidden = x.shape
    dynamic = conv.kernel_projection(x).view(n, length, 2, conv.kernel_size, conv.num_groups)
    dynamic = dynamic.repeat_interleave(conv.group_size, dim=-1)  # one correction per group of channels
    out = torch.zeros_like(x)
    for t in range(length):
        for j in range(min(conv.kernel_size, t + 1)):
            out[:, t] += (conv.base_kernel[side, j] + dynamic[:, t, side, j]) * x[:, t - j]
    return out


@pytest.mark.parametrize("kernel_size,length", [(1, 4), (2, 8), (3, 8), (4, 3)])
def test_local_convolution_is_the_grouped_dynamic_causal_formula(kernel_size, length):
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(hidden_size=32, kernel_size=kernel_size, group_size=8)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.2)
    x = torch.randn(3, length, 32)
    kernels = conv.kernels(x)
    assert kernels.shape == (3, length, 2, 4, 8, kernel_size)
    for side in (0, 1):
        torch.testing.assert_close(conv.mix(x, kernels[:, :, side]), _reference_mix(conv, x, side))


def test_local_convolution_is_causal_and_differentiable():
    torch.manual_seed(1)
    conv = GroupedDynamicCausalConv(hidden_size=16, kernel_size=2, group_size=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
    x = torch.randn(1, 6, 16, requires_grad=True)
    out = conv.mix(x, conv.kernels(x.detach())[:, :, 0])
    out[0, 2].sum().backward()
    # position 2 reads positions 2 and 1 only (two taps), never a later one
    assert x.grad[0, 3:].abs().sum() == 0 and x.grad[0, 0].abs().sum() == 0
    assert x.grad[0, 1].abs().sum() > 0 and x.grad[0, 2].abs().sum() > 0
    loss = conv.mix(x, conv.kernels(x)[:, :, 1]).square().sum()
    loss.backward()
    assert conv.base_kernel.grad.abs().sum() > 0 and conv.kernel_projection.weight.grad.abs().sum() > 0
