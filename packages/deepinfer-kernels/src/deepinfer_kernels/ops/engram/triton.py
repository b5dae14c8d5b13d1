"""Triton Engram row gather (CUDA backend ``triton`` of ``engram_gather_rows``), reading host tables in place.

One program per looked-up row: it loads the row id, the Dh stored values and the Dh / 32 UE8M0 scales, and
writes the dequantised row (fp32 product, one rounding to the output dtype: the reference's bits). The table may
sit on the device or in pinned host memory: pinned memory is mapped into the device's address space (unified
addressing), so the kernel reads the few hundred bytes of each row over the host link and nothing waits for the
device. That keeps a decode step with a 100 GB host table free of host syncs, hence capturable in a CUDA graph.
A table in pageable host memory goes through the reference (the host gathers).
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._triton_launch import require_same_device, triton_cuda_available
from deepinfer_kernels.ops.fp8_gemm.triton import e8m0_to_f32
from deepinfer_kernels.registry import register_backend

from .reference import engram_gather_rows_ref


@triton.jit
def _gather_kernel(rows_ptr, scale_ptr, ids_ptr, out_ptr, DH, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + i)
    cols = tl.arange(0, BLOCK)
    m = cols < DH
    v = tl.load(rows_ptr + row * DH + cols, mask=m).to(tl.float32)  # no `other`: fp8 has no literal 0 here
    if SCALED:
        v = v * e8m0_to_f32(tl.load(scale_ptr + row * (DH // 32) + cols // 32, mask=m, other=127))
    tl.store(out_ptr + i * DH + cols, v.to(out_ptr.dtype.element_ty), mask=m)


def engram_gather_rows_triton(
    rows: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    host = rows.device.type == "cpu" and ids.device.type == "cuda"
    odd_scale = scale is not None and (
        scale.dtype not in (torch.float8_e8m0fnu, torch.uint8) or not scale.is_contiguous()
    )
    if (host and not rows.is_pinned()) or rows.stride() != (rows.shape[1], 1) or odd_scale:
        return engram_gather_rows_ref(rows, scale, ids, out_dtype)
    if not host:
        require_same_device(rows, ids, *([scale] if scale is not None else []))
    t, c = ids.shape
    dh = rows.shape[1]
    out = torch.empty(t, c * dh, dtype=out_dtype, device=ids.device)
    if out.numel():
        sc = scale.view(torch.uint8) if scale is not None else rows  # dummy pointer when unscaled
        _gather_kernel[(t * c,)](
            rows, sc, ids.contiguous(), out, dh,
            SCALED=scale is not None, BLOCK=triton.next_power_of_2(dh), num_warps=1,
        )  # fmt: skip
    return out


engram_gather_rows_triton.reads_pinned_host = True

register_backend(
    "engram_gather_rows", "triton", engram_gather_rows_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip
