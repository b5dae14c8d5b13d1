"""engram_gate_inject: the Triton kernel vs the reference under Triton's interpreter on CPU (one and several
channel blocks, fp32 and bf16 streams, key and value as strided views of one projection as in the model, the
image mask, an all-zero stream whose dot is 0) and on CUDA at V4.1 shapes (4 streams of 4096), where a token
alone also equals the same token among 2048, bitwise."""

import pytest
import torch
from deepinfer_kernels import engram_gate_inject
from deepinfer_kernels.ops.engram.reference import engram_gate_inject_ref

pytest.importorskip("triton")

from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402


def _inputs(t: int, n: int, d: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, d, generator=g) * 3).to(dtype)
    kv = torch.randn(t, n + 1, d, generator=g).to(dtype)  # the model's projection: n keys, then the value
    w = torch.randn(n, d, generator=g)
    mask = torch.rand(t, generator=g) < 0.3
    x[0, 1] = 0  # dot 0: gate 1/2
    return [a.to(device) for a in (x, kv[:, :n], kv[:, n], w, mask)]


def _interp_matches_reference(d: int, dtype_name: str):
    from deepinfer_kernels.ops.engram.triton import engram_gate_inject_triton

    dtype = getattr(torch, dtype_name)
    x, key, value, w, mask = _inputs(9, 4, d, dtype, seed=d)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the same fp32 value up to a few ulp, rounded once
    for m in (None, mask):
        got = engram_gate_inject_triton(x, key, value, w, m, 1e-20)
        want = engram_gate_inject_ref(x, key, value, w, m, 1e-20)
        assert got.dtype == dtype and got.shape == x.shape
        assert_rel_close(got, want, tol, f"d={d} {dtype} mask={m is not None}")
    # the gate itself, recovered from fp32 streams: gate = (out - x) / value
    x32, key32, value32 = x.float(), key.float(), value.float()
    got = engram_gate_inject_triton(x32, key32, value32, w, None, 1e-20)
    want = engram_gate_inject_ref(x32, key32, value32, w, None, 1e-20)
    gate_got, gate_want = (got - x32) / value32[:, None], (want - x32) / value32[:, None]
    assert_rel_close(gate_got[:, :, :8], gate_want[:, :, :8], 1e-4, f"gate d={d}")
    assert torch.allclose(gate_got[0, 1], torch.full_like(gate_got[0, 1], 0.5), atol=1e-5)


INTERP_CASES = {
    "d300-fp32": ("_interp_matches_reference", (300, "float32")),
    "d2500-bf16": ("_interp_matches_reference", (2500, "bfloat16")),
}

test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


@pytest.mark.gpu
def test_gpu_v41_shapes_and_batch_invariance():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer_kernels import registry
    from deepinfer_kernels.ops.engram.triton import engram_gate_inject_triton

    assert registry.resolve("engram_gate_inject", "cuda") is engram_gate_inject_triton
    x, key, value, w, mask = _inputs(2048, 4, 4096, torch.bfloat16, seed=5, device="cuda")
    for m in (None, mask):
        got = engram_gate_inject(x, key, value, w, m)
        assert_rel_close(got, engram_gate_inject_ref(x, key, value, w, m), 1e-2, f"bf16 mask={m is not None}")
        for tok in (0, 7, 2047):
            one = engram_gate_inject(x[tok : tok + 1], key[tok : tok + 1], value[tok : tok + 1], w,
                                     None if m is None else m[tok : tok + 1])  # fmt: skip
            assert_bitwise(one, got[tok : tok + 1], f"token {tok} alone vs among 2048")
    xf, kf, vf = x.float(), key.float(), value.float()
    assert_rel_close(engram_gate_inject(xf, kf, vf, w, None), engram_gate_inject_ref(xf, kf, vf, w, None), 1e-5, "fp32")
