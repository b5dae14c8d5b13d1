"""Programmatic dependent launch (``_triton_launch.pdl_options``): off on the CPU, in the interpreter and with
``DEEPINFER_PDL=0``; on an sm_90+ GPU a chain of dependent Triton kernels (each reads what the one before wrote:
RMSNorm, the skinny GEMV with its last-program fixup, RoPE in place, top-k over the result) gives the same bits
with it as without, eagerly and replayed from a CUDA graph, so every kernel's prologue waits for its predecessor."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels import linear, rms_norm, rope_interleaved, rope_inv_freq, topk_select  # noqa: E402
from deepinfer_kernels.ops import _triton_launch  # noqa: E402
from deepinfer_kernels.ops._triton_launch import PDL_ENV, pdl_options, without_early_launch  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise  # noqa: E402


def test_off_on_cpu_and_by_environment(monkeypatch):
    assert pdl_options(torch.device("cpu")) == {}
    monkeypatch.setenv(PDL_ENV, "0")
    assert pdl_options(torch.device("cuda", 0)) == {}  # read per launch: no CUDA query when switched off


def test_without_early_launch_drops_only_the_attribute(monkeypatch):
    """Inside ``without_early_launch()`` a Hopper launch keeps its kernel (PDL=True: the same binary) and loses the
    launch attribute; nesting counts, ``active=False`` changes nothing, and leaving restores it. (The CUDA device
    query is stubbed: only the option logic is under test.)"""
    monkeypatch.setattr(_triton_launch, "_pdl_options", lambda index: {"PDL": True, "launch_pdl": True})
    monkeypatch.setattr(_triton_launch, "interpreting", lambda: False)
    dev, on = torch.device("cuda", 0), {"PDL": True, "launch_pdl": True}
    assert pdl_options(dev) == on
    with without_early_launch():
        assert pdl_options(dev) == {"PDL": True}
        with without_early_launch(False):
            assert pdl_options(dev) == {"PDL": True}
        with without_early_launch():
            assert pdl_options(dev) == {"PDL": True}
        assert pdl_options(dev) == {"PDL": True}
    with without_early_launch(False):
        assert pdl_options(dev) == on
    assert pdl_options(dev) == on
    assert pdl_options(torch.device("cpu")) == {}


def _chain(x, w_norm, weights, inv_freq, pos):
    """40 dependent launches on [rows, 512] bf16 activations; returns the last activations and the top-k ids."""
    for w in weights:
        x = rms_norm(x, w_norm, 1e-6)
        x = linear(x, w)  # skinny GEMV: K split over programs, the last one adds the partials
        x = rope_interleaved(x.view(x.shape[0], 8, 64), pos, inv_freq, out=x.view(x.shape[0], 8, 64)).view_as(x)
    return x, topk_select(x.float(), 16)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm_90+ GPU"
)
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_chain_bitwise_with_and_without(monkeypatch, rows):
    assert pdl_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    g = torch.Generator(device="cuda").manual_seed(rows)
    x0 = torch.randn(rows, 512, generator=g, device="cuda").to(torch.bfloat16)
    w_norm = (1 + 0.1 * torch.randn(512, generator=g, device="cuda")).to(torch.bfloat16)
    weights = [(torch.randn(512, 512, generator=g, device="cuda") / 16).to(torch.bfloat16) for _ in range(13)]
    inv_freq = rope_inv_freq(64, 10000.0).cuda()
    pos = torch.arange(rows, device="cuda") + 17

    monkeypatch.setenv(PDL_ENV, "0")
    want = _chain(x0, w_norm, weights, inv_freq, pos)
    monkeypatch.delenv(PDL_ENV)
    got = _chain(x0, w_norm, weights, inv_freq, pos)
    for a, b, what in zip(got, want, ("activations", "top-k"), strict=True):
        assert_bitwise(a, b, f"eager {what}, PDL on vs off")

    x_in = x0.clone()
    _chain(x_in, w_norm, weights, inv_freq, pos)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x_in, w_norm, weights, inv_freq, pos)
    for _ in range(3):
        x_in.copy_(torch.randn(rows, 512, generator=g, device="cuda").to(torch.bfloat16))
        graph.replay()
        monkeypatch.setenv(PDL_ENV, "0")
        eager = _chain(x_in, w_norm, weights, inv_freq, pos)
        monkeypatch.delenv(PDL_ENV)
        for a, b, what in zip(out, eager, ("activations", "top-k"), strict=True):
            assert_bitwise(a, b, f"graph replay {what} (PDL) vs eager without")


def _stream_chain(x, w_norm, pairs):
    """Weight streams in a dependent chain: [rows, 2048] -> [rows, 16384] (one K split, 4 stages) -> [rows, 2048]
    (narrow at 1-2 rows, cuBLAS above) -> RMSNorm, and a [rows, 8192] x [4096, 8192]^T stream of 4 K splits (the
    last program adds the partials)."""
    for up, down, wide in pairs:
        x = rms_norm(linear(linear(x, up), down), w_norm, 1e-6)
        y = linear(torch.cat([x, x, x, x], dim=-1), wide)
        x = y[:, :2048] + y[:, 2048:]
    return x


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm_90+ GPU"
)
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_weight_streams_bitwise_with_and_without(monkeypatch, rows):
    g = torch.Generator(device="cuda").manual_seed(100 + rows)

    def w(n, k):
        return (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)

    x0 = torch.randn(rows, 2048, generator=g, device="cuda").to(torch.bfloat16)
    w_norm = (1 + 0.1 * torch.randn(2048, generator=g, device="cuda")).to(torch.bfloat16)
    pairs = [(w(16384, 2048), w(2048, 16384), w(4096, 8192)) for _ in range(2)]
    monkeypatch.setenv(PDL_ENV, "0")
    want = _stream_chain(x0, w_norm, pairs)
    monkeypatch.delenv(PDL_ENV)
    assert_bitwise(_stream_chain(x0, w_norm, pairs), want, "eager, PDL on vs off")
    x_in = x0.clone()
    _stream_chain(x_in, w_norm, pairs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _stream_chain(x_in, w_norm, pairs)
    for _ in range(3):
        x_in.copy_(torch.randn(rows, 2048, generator=g, device="cuda").to(torch.bfloat16))
        graph.replay()
        monkeypatch.setenv(PDL_ENV, "0")
        eager = _stream_chain(x_in, w_norm, pairs)
        monkeypatch.delenv(PDL_ENV)
        assert_bitwise(out, eager, "graph replay (PDL) vs eager without")
