"""Triton Engram ops (CUDA backends ``triton``): the row gather, reading host tables in place, and the gated
injection into the hc streams.

One program per looked-up row: it loads the row id, the Dh stored values and the Dh / 32 UE8M0 scales, and
writes the dequantised row (fp32 product, one rounding to the output dtype: the reference's bits). The table may
sit on the device or in pinned host memory: pinned memory is mapped into the device's address space (unified
addressing), so the kernel reads the few hundred bytes of each row over the host link and nothing waits for the
device. That keeps a decode step with a 100 GB host table free of host syncs, hence capturable in a CUDA graph.
A table in pageable host memory goes through the reference (the host gathers).

``engram_gate_inject``: one program per (token, stream) walks the stream's d channels twice, first for the three
sums (x^2, key^2, x w key), then to add gate x value; the reference's dozen fp32 passes over [T, n, d] tensors are
a few ms of a V4.1 prefill. The dot is taken as sum(x w key) times the two rsqrt factors (the reference scales x
and key first): the gate agrees to a few ulp of fp32, the output to one bf16 rounding. A program reads only its
own token: batch-invariant.
"""

import math

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.ops.quant.formats import is_ue8m0
from deepinfer_kernels.ops.quant.triton import e8m0_to_f32
from deepinfer_kernels.registry import register_backend

from .reference import engram_gate_inject_ref, engram_gather_rows_ref


@triton.jit
def _gather_kernel(
    rows_ptr, scale_ptr, ids_ptr, out_ptr, DH, SCALED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_prologue(PDL)
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
    odd_scale = scale is not None and (not is_ue8m0(scale) or not scale.is_contiguous())
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
            SCALED=scale is not None, BLOCK=triton.next_power_of_2(dh), num_warps=1, **pdl_options(rows.device),
        )  # fmt: skip
    return out


engram_gather_rows_triton.reads_pinned_host = True

register_backend(
    "engram_gather_rows", "triton", engram_gather_rows_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip


@triton.jit
def _gate_kernel(
    x_ptr, k_ptr, v_ptr, w_ptr, mask_ptr, out_ptr, D, x_st, k_st, v_st, eps, inv_sqrt_d,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    n = tl.num_programs(1)
    x_row = x_ptr + t * x_st + j * D
    k_row = k_ptr + t * k_st + j * D
    sx = tl.zeros([BLOCK], tl.float32)
    sk = tl.zeros([BLOCK], tl.float32)
    sd = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, D, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < D
        x = tl.load(x_row + c, mask=m, other=0.0).to(tl.float32)
        k = tl.load(k_row + c, mask=m, other=0.0).to(tl.float32)
        sx += x * x
        sk += k * k
        sd += x * tl.load(w_ptr + j * D + c, mask=m, other=0.0).to(tl.float32) * k
    dot = tl.sum(sd) / tl.sqrt(tl.sum(sx) / D + eps) / tl.sqrt(tl.sum(sk) / D + eps) * inv_sqrt_d
    sign = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, dot))  # 0 and NaN stay themselves, as torch.sign
    gate = 1.0 / (1.0 + tl.exp(-(sign * tl.sqrt(tl.maximum(tl.abs(dot), 1e-6)))))
    if HAS_MASK:
        gate = tl.where(tl.load(mask_ptr + t) != 0, 0.0, gate)
    out_row = out_ptr + (t * n + j) * D
    for c0 in range(0, D, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < D
        x = tl.load(x_row + c, mask=m, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * v_st + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out_row + c, (x + gate * v).to(out_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit channel stride and dense (stream, channel) dims; the token stride stays free (the model's
    key and value are views of one [T, n + 1, d] projection)."""
    dense = t.stride(-1) == 1 and (t.dim() == 2 or t.stride(-2) == t.shape[-1])
    return t if dense else t.contiguous()


def engram_gate_inject_triton(x, key, value, w, image_mask, eps=1e-20):
    if x.dim() != 3:  # the model's [T, n, d]; other ranks keep the reference
        return engram_gate_inject_ref(x, key, value, w, image_mask, eps)
    mask = image_mask.to(torch.uint8).contiguous() if image_mask is not None else None
    require_same_device(x, key, value, w, *([mask] if mask is not None else []))
    x, key, value, w = _rows(x), _rows(key), _rows(value), w.float().contiguous()
    t, n, d = x.shape
    out = torch.empty(t, n, d, dtype=x.dtype, device=x.device)
    if out.numel():
        _gate_kernel[(t, n)](
            x, key, value, w, mask if mask is not None else x, out, d, x.stride(0), key.stride(0), value.stride(0),
            float(eps), 1.0 / math.sqrt(d), HAS_MASK=mask is not None, BLOCK=min(triton.next_power_of_2(d), 2048),
            num_warps=4, **pdl_options(x.device),
        )  # fmt: skip
    return out


register_backend(
    "engram_gate_inject", "triton", engram_gate_inject_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip
