"""The K-split GEMMs' sum in their own launch (``split_k.store_split_tile``): bitwise the second launch's sum
(``split_k.SUM_IN_KERNEL`` off), every arrival counter back at zero after the call, and the calls of more tiles
than counters on the second launch. Under Triton's interpreter on CPU (``linear``, ``grouped_linear`` and the
FP8 kernels, small shapes) and on CUDA at V4.1-Flash decode shapes (with the Gluon FP8 kernel, and in a CUDA
graph replayed twice)."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops import split_k  # noqa: E402
from deepinfer_kernels.ops._triton_launch import COUNTERS, counter_block  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402


def _both_ways(fn, what: str) -> torch.Tensor:
    """fn() with the sum in the kernel and with the second launch: bitwise equal, counters left at zero."""
    old = split_k.SUM_IN_KERNEL, split_k.SUM_IN_KERNEL_MAX_ROWS
    try:
        split_k.SUM_IN_KERNEL, split_k.SUM_IN_KERNEL_MAX_ROWS = True, 1 << 30
        fused = fn()
        split_k.SUM_IN_KERNEL = False
        second = fn()
    finally:
        split_k.SUM_IN_KERNEL, split_k.SUM_IN_KERNEL_MAX_ROWS = old
    assert_bitwise(fused, second, what)
    cnt = counter_block(fused.device)
    assert int(cnt.abs().sum()) == 0, f"{what}: arrival counters left at {cnt.nonzero().flatten()[:8].tolist()}"
    return fused


def _cases(device: str) -> list:
    """(name, call) of every split-K GEMM backend at shapes that split K (two or more parts)."""
    from deepinfer_kernels import act_quant_fp8, fp8_block_quantize
    from deepinfer_kernels.ops.fp8_gemm import triton as ft
    from deepinfer_kernels.ops.fp8_gemm import triton_bf16 as tb
    from deepinfer_kernels.ops.grouped_linear.triton import grouped_linear_triton_fixed
    from deepinfer_kernels.ops.linear.triton import linear_triton_fixed

    g = torch.Generator().manual_seed(7)
    cpu = device == "cpu"
    m, n, k = (3, 70, 1024) if cpu else (4, 5120, 8192)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).to(device)
    gx = torch.randn(m, 2 if cpu else 8, 1024 if cpu else 4096, generator=g).to(torch.bfloat16).to(device)
    gw = (torch.randn((2 if cpu else 8) * (40 if cpu else 1024), gx.shape[2], generator=g) * 0.05).to(torch.bfloat16)
    gw = gw.to(device)
    a, sa = act_quant_fp8(x, 32, scale_dtype=torch.float8_e8m0fnu)
    b, sb = fp8_block_quantize(w, (32, 32), scale_fmt="ue8m0")
    bf16_cfg = dict(tb.bf16_config(m, n, k), split=4)
    cases = [
        ("linear", lambda: linear_triton_fixed(x, w)),
        ("linear fp32 out", lambda: linear_triton_fixed(x, w, out_dtype=torch.float32)),
        ("grouped_linear", lambda: grouped_linear_triton_fixed(gx, gw)),
        ("fp8 triton", lambda: ft.fp8_gemm_nt_triton_fixed(a, sa, b, sb, 32)),
        ("fp8 bf16 kernel", lambda: tb.fp8_gemm_nt_triton_bf16(a, sa, b, sb, 32, cfg=bf16_cfg)),
    ]
    if not cpu:
        from deepinfer_kernels.ops.fp8_gemm import gluon

        for rows in (1, 8, 13):
            xr = torch.randn(rows, 1280, generator=g).to(device)
            wr = (torch.randn(32768, 1280, generator=g) / 36).to(device)
            ar, sar = act_quant_fp8(xr, 32, scale_dtype=torch.float8_e8m0fnu)
            br, sbr = fp8_block_quantize(wr, (32, 32), scale_fmt="ue8m0")
            ops = (ar, sar, br, sbr)
            cases.append((f"fp8 gluon wq_b {rows}", lambda ops=ops: gluon.fp8_gemm_nt_gluon(*ops, 32)))
        cases.append(("fp8 gluon wo_b 4", lambda: gluon.fp8_gemm_nt_gluon(a, sa, b, sb, 32)))
    return cases


def _check_cases(device: str) -> None:
    """Every case both ways, each call split along K (the parts recorded as ``SplitOutput.finish`` sees them)."""
    finish = split_k.SplitOutput.finish
    seen: list[int] = []

    def record(out):
        seen.append(out.split)
        return finish(out)

    split_k.SplitOutput.finish = record
    try:
        for name, fn in _cases(device):
            seen.clear()
            _both_ways(fn, name)
            assert seen and min(seen) > 1, f"{name}: not split along K ({seen})"
    finally:
        split_k.SplitOutput.finish = finish


def _interp_in_kernel_sum() -> None:
    _check_cases("cpu")


INTERP_CASES = {"in-kernel-sum": ("_interp_in_kernel_sum", ())}
test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # one TRITON_INTERPRET=1 child process


def test_split_output_falls_back_past_the_counters(monkeypatch):
    """More tiles than counters, or more rows than SUM_IN_KERNEL_MAX_ROWS: the parts go to the second launch;
    unsplit: c itself, nothing to finish."""
    monkeypatch.setattr(split_k, "SUM_IN_KERNEL", True)
    monkeypatch.setattr(split_k, "SUM_IN_KERNEL_MAX_ROWS", 4)
    c = torch.empty(4, 8)
    assert split_k.split_output(c, 4, COUNTERS).in_kernel
    assert not split_k.split_output(torch.empty(5, 8), 4, 10).in_kernel
    out = split_k.split_output(c, 4, COUNTERS + 1)
    assert not out.in_kernel and out.ws.shape == (4, 4, 8) and out.ws.dtype == torch.float32
    one = split_k.split_output(c, 1, 10)
    assert one.ws is c and one.finish() is c


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_in_kernel_sum_bitwise():
    """Every backend at V4.1 decode shapes: the same bits either way, counters back at zero."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 kernels need sm_90")
    _check_cases("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_in_kernel_sum_graph_replays(monkeypatch):
    """Captured in a CUDA graph and replayed twice on new inputs: each replay equals an eager call (the counters a
    replay finds are the ones the previous replay left at zero)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 kernels need sm_90")
    monkeypatch.setattr(split_k, "SUM_IN_KERNEL", True)
    monkeypatch.setattr(split_k, "SUM_IN_KERNEL_MAX_ROWS", 2)
    from deepinfer_kernels import act_quant_fp8, fp8_block_quantize
    from deepinfer_kernels.ops.fp8_gemm import gluon

    g = torch.Generator(device="cuda").manual_seed(3)
    b, sb = fp8_block_quantize(torch.randn(5120, 8192, generator=g, device="cuda") / 90, (32, 32), scale_fmt="ue8m0")
    x = torch.randn(2, 8192, generator=g, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        gluon.fp8_gemm_nt_gluon(*act_quant_fp8(x, 32, scale_dtype=torch.float8_e8m0fnu), b, sb, 32)  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            y = gluon.fp8_gemm_nt_gluon(*act_quant_fp8(x, 32, scale_dtype=torch.float8_e8m0fnu), b, sb, 32)
    for _ in range(2):
        x.copy_(torch.randn(2, 8192, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want = gluon.fp8_gemm_nt_gluon(*act_quant_fp8(x, 32, scale_dtype=torch.float8_e8m0fnu), b, sb, 32)
        assert_bitwise(y, want, "replay vs eager")
