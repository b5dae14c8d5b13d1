"""V4's mHC site (``deepseek_v4.Block.site``) on CUDA: at decode sizes the sublayer's input is made from the site's
pre rows alone (``mhc_pre_collapse_rms_norm``) and post / comb come from a side lane; the result agrees with the
single-path wiring (``mhc_same_site_sublayer``) to bf16 rounding, with the sublayer returning one output or two
addends. Past SPLIT_SITE_MAX_TOKENS tokens, in batch-invariant mode and on the CPU the site is the single path,
bitwise."""

import pytest
import torch
from deepinfer_kernels import mhc_same_site_sublayer
from deepinfer_kernels.registry import set_batch_invariant
from deepinfer_runtime.models import deepseek_v4
from deepinfer_runtime.models.layers import MhcBlock, Norm

N, D = 4, 4096  # V4-Flash


class _Site(MhcBlock):
    site = deepseek_v4.Block.site


def _block(device: str, seed: int) -> tuple[_Site, Norm]:
    g = torch.Generator().manual_seed(seed)
    b = _Site(hc_mult=N, hidden=D, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    for site in ("attn", "ffn"):
        getattr(b, f"hc_{site}_fn").copy_(torch.randn((2 + N) * N, N * D, generator=g) * 2 / (N * D) ** 0.5)
        getattr(b, f"hc_{site}_base").copy_(torch.randn((2 + N) * N, generator=g) * 0.5)
        getattr(b, f"hc_{site}_scale").copy_(0.5 + torch.rand(3, generator=g))
    norm = Norm(D, 1e-6)
    norm.weight.copy_(0.5 + torch.rand(D, generator=g))
    return b.to(device), norm.to(device)


def _sublayer(u: torch.Tensor) -> torch.Tensor:
    return torch.tanh(u.float()).to(u.dtype)


def _pair(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _sublayer(u), (0.5 * u.float()).to(u.dtype)


def _single(b: _Site, x: torch.Tensor, f, site: str, norm: Norm) -> torch.Tensor:
    return mhc_same_site_sublayer(x, f, b.mhc(site), b.hc, norm=norm.fused)


def test_cpu_site_is_the_single_path():
    b, norm = _block("cpu", 0)
    x = torch.randn(3, N, D)
    assert torch.equal(b.site(x, _sublayer, "attn", norm), _single(b, x, _sublayer, "attn", norm))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 65])
def test_gpu_site_matches_the_single_path(t):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    b, norm = _block("cuda", t)
    x = torch.randn(t, N, D, device="cuda").bfloat16()
    for f, site in ((_sublayer, "attn"), (_pair, "ffn")):
        got, want = b.site(x, f, site, norm), _single(b, x, f, site, norm)
        torch.cuda.synchronize()
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        if t > deepseek_v4.SPLIT_SITE_MAX_TOKENS:
            assert torch.equal(got, want), f"T={t} {site}: past the split's sizes the single path, bitwise"
        else:  # pre of n mixes against pre of (2+n)n: fp32 rounding apart, then bf16 streams
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 2e-3, f"T={t} {site}: relative error {err:.2e}"
    set_batch_invariant(True)
    try:
        assert torch.equal(b.site(x, _sublayer, "attn", norm), _single(b, x, _sublayer, "attn", norm))
    finally:
        set_batch_invariant(None)
