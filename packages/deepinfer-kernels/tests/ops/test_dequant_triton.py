"""fp8_block_dequantize and act_dequant_fp8: the Triton kernel vs the references, bitwise, under Triton's
interpreter on CPU and on CUDA at V4 / V4.1 shapes: UE8M0 bytes (255 included: NaN blocks; on CUDA also 0, 2^-127,
whose bf16 / fp16 results are subnormal: the interpreter's casts of subnormals are not the GPU's), float8_e8m0fnu
and float32 scales, partial edge blocks, fp32 / bf16 / fp16 outputs (fp16 rounds and overflows as torch's cast)."""

import pytest
import torch
from deepinfer_kernels.ops.quant.reference import act_dequant_fp8_ref, fp8_block_dequantize_ref

pytest.importorskip("triton")

from deepinfer_kernels.testing.compare import assert_bitwise  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402


def _operands(rows: int, k: int, b0: int, b1: int, seed: int, scale_fmt: str, device="cpu"):
    """Random e4m3 codes (every finite code, NaN excluded) and block scales spanning 2^-40 .. 2^20."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # e4m3fn's NaN codes -> 1.5
    q = codes.view(torch.float8_e4m3fn)
    shape = (-(-rows // b0), -(-k // b1))
    e = torch.randint(127 - 40, 127 + 21, shape, generator=g, dtype=torch.int32)
    if scale_fmt == "float":
        s = torch.pow(2.0, (e - 127).float())
    else:
        e.view(-1)[:2] = torch.tensor([255 if device == "cpu" else 0, 255], dtype=torch.int32)  # 2^-127, NaN
        s = e.to(torch.uint8)
        if scale_fmt == "e8m0fnu":
            s = s.view(torch.float8_e8m0fnu)
    return q.to(device), s.to(device)


def _cases(device: str) -> None:
    from deepinfer_kernels.ops.quant.dequant_triton import act_dequant_fp8_triton, fp8_block_dequantize_triton

    for (rows, k, b), fmt in (((70, 300, 32), "ue8m0"), ((130, 256, 128), "float"), ((33, 96, 32), "e8m0fnu")):
        q, s = _operands(rows, k, b, b, seed=rows + k, scale_fmt=fmt, device=device)
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            got = fp8_block_dequantize_triton(q, s, (b, b), dt)
            assert_bitwise(got, fp8_block_dequantize_ref(q, s, (b, b), dt), f"block {rows}x{k}/{b} {fmt} {dt}")
        qa, sa = _operands(rows, k, 1, b, seed=rows * k, scale_fmt=fmt, device=device)
        qa, sa = qa.view(rows, 1, k), sa.view(rows, 1, -1)  # leading dims
        for dt in (torch.float32, torch.bfloat16):
            got = act_dequant_fp8_triton(qa, sa, b, dt)
            assert_bitwise(got, act_dequant_fp8_ref(qa, sa, b, dt), f"act {rows}x{k}/{b} {fmt} {dt}")


def _interp_bitwise():
    _cases("cpu")


INTERP_CASES = {"dequant": ("_interp_bitwise", ())}

test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


@pytest.mark.gpu
def test_gpu_bitwise_and_dispatch():
    """Bitwise on CUDA, and the ops dispatch there to the Triton kernel (a V4.1 wq_b weight, a prefill activation)."""
    from deepinfer_kernels.ops.quant import act_dequant_fp8, fp8_block_dequantize
    from deepinfer_kernels.ops.quant.dequant_triton import act_dequant_fp8_triton, fp8_block_dequantize_triton
    from deepinfer_kernels.registry import resolve

    _cases("cuda")
    assert resolve("fp8_block_dequantize", "cuda") is fp8_block_dequantize_triton
    assert resolve("act_dequant_fp8", "cuda") is act_dequant_fp8_triton
    q, s = _operands(32768, 1280, 32, 32, seed=1, scale_fmt="ue8m0", device="cuda")
    got = fp8_block_dequantize(q, s, (32, 32), torch.bfloat16)
    assert_bitwise(got, fp8_block_dequantize_ref(q, s, (32, 32), torch.bfloat16), "wq_b")
    qa, sa = _operands(4096, 5120, 1, 32, seed=2, scale_fmt="float", device="cuda")
    assert_bitwise(act_dequant_fp8(qa, sa, 32, torch.bfloat16), act_dequant_fp8_ref(qa, sa, 32, torch.bfloat16), "x")
