"""The C++ RMSNorm (ember.kernels.cpu_norm) behind the model's RMSNorm seam: the torch path's formula
and bits, a row's result independent of the rows beside it, set on bf16 models only."""
from __future__ import annotations

import torch

from ember.kernels import cpu_norm, optimize
from ember.model.llama import RMSNorm


def test_the_kernel_gives_the_torch_paths_bits_row_by_row():
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(576).to(torch.bfloat16)
    x = (torch.randn(64, 576) * torch.logspace(-3, 2, 64)[:, None]).to(torch.bfloat16)  # small and large rows
    want = norm(x)
    norm.kernel = cpu_norm.rms_norm
    got = norm(x)
    assert torch.equal(got, want)
    for rows in (slice(5, 6), slice(0, 12), slice(17, 64)):
        assert torch.equal(norm(x[rows]), got[rows])
    assert torch.equal(norm(x.view(8, 8, 576)), got.view(8, 8, 576))


def test_optimize_sets_it_on_bf16_norms_only(loaded):
    fp32 = RMSNorm(576, 1e-5)
    bf16 = RMSNorm(576, 1e-5).to(torch.bfloat16)
    model = torch.nn.ModuleList([fp32, bf16])
    assert "cpp-rms-norm" in optimize(model)
    assert bf16.kernel is cpu_norm.rms_norm and fp32.kernel is None  # the exact path keeps F.rms_norm
    assert all(m.kernel is None for m in loaded.model.modules() if isinstance(m, RMSNorm))  # fp32 model
