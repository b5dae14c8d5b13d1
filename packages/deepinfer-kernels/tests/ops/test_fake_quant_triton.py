"""fake_quant_fp8_ue8m0 and fake_quant_e2m1: the Triton kernels vs the references, bitwise, under Triton's
interpreter on CPU and on CUDA at V4.1 shapes (window KV 512 / block 32 FP8; compressed KV 512 / block 16 E2M1 with
E4M3 scales; index keys and queries 128 / block 32 E2M1 with UE8M0 scales). The inputs include all-zero blocks,
blocks below the scale floors, values on the E2M1 rounding ties, negative values that round to -0.0, and values
past the FP8 range of their block."""

import pytest
import torch
from deepinfer_kernels.ops.quant import fake_quant_e2m1, fake_quant_fp8_ue8m0
from deepinfer_kernels.ops.quant.reference import fake_quant_e2m1_ref, fake_quant_fp8_ue8m0_ref

pytest.importorskip("triton")

from deepinfer_kernels.testing.compare import assert_bitwise  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.1, 6.0)


def _inputs(rows: int, d: int, block: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g) * torch.exp(torch.randn(rows, d // block, 1, generator=g) * 3).repeat(
        1, 1, block
    ).view(rows, d)
    x[0, :block] = 0  # an all-zero block
    x[0, block : 2 * block] *= 1e-30  # below every floor
    if d >= 3 * block:  # a block whose amax is 6 * 2^-3: x / s lands on the E2M1 ties (UE8M0 scale 2^-3)
        x[1, 2 * block : 3 * block] = 0
        x[1, 2 * block : 2 * block + len(TIES)] = torch.tensor(TIES) * 2.0**-3
    return x.to(dtype)


def _cases(dtype: torch.dtype):
    from deepinfer_kernels.ops.quant.fake_quant_triton import fake_quant_e2m1_triton, fake_quant_fp8_ue8m0_triton

    for d, block in ((512, 32), (448, 64), (96, 32)):
        x = _inputs(6, d, block, dtype, seed=d + block)
        assert_bitwise(fake_quant_fp8_ue8m0_triton(x, block), fake_quant_fp8_ue8m0_ref(x, block), f"fp8 {d}/{block}")
    for d, block, fmt in ((512, 16, "e4m3"), (128, 32, "ue8m0"), (512, 32, "ue8m0"), (64, 16, "e4m3")):
        x = _inputs(5, d, block, dtype, seed=d * block)
        got, want = fake_quant_e2m1_triton(x, block, fmt), fake_quant_e2m1_ref(x, block, fmt)
        assert_bitwise(got, want, f"e2m1 {fmt} {d}/{block}")
    x = _inputs(3, 128, 32, dtype, seed=1).view(3, 4, 32)  # leading dims are rows too
    assert_bitwise(fake_quant_e2m1_triton(x, 32, "ue8m0"), fake_quant_e2m1_ref(x, 32, "ue8m0"), "3-D")


def _interp_bitwise(dtype_name: str):
    _cases(getattr(torch, dtype_name))


INTERP_CASES = {"fp32": ("_interp_bitwise", ("float32",)), "bf16": ("_interp_bitwise", ("bfloat16",))}

test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


@pytest.mark.gpu
def test_gpu_v41_shapes_bitwise():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer_kernels import registry
    from deepinfer_kernels.ops.quant.fake_quant_triton import fake_quant_e2m1_triton

    assert registry.resolve("fake_quant_e2m1", "cuda") is fake_quant_e2m1_triton
    for dtype in (torch.bfloat16, torch.float32):
        x = _inputs(4096, 512, 32, dtype, seed=3).cuda()
        assert_bitwise(fake_quant_fp8_ue8m0(x, 32), fake_quant_fp8_ue8m0_ref(x, 32), f"fp8 window KV {dtype}")
        x = _inputs(4096, 512, 16, dtype, seed=4).cuda()
        assert_bitwise(fake_quant_e2m1(x, 16, "e4m3"), fake_quant_e2m1_ref(x, 16, "e4m3"), f"e2m1 e4m3 {dtype}")
        x = _inputs(4096, 128, 32, dtype, seed=5).cuda()
        assert_bitwise(fake_quant_e2m1(x, 32, "ue8m0"), fake_quant_e2m1_ref(x, 32, "ue8m0"), f"e2m1 ue8m0 {dtype}")
