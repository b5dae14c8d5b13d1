"""Triton clamped SwiGLU (CUDA backend ``triton`` of ``swiglu_clamp``) and the shared expert on it (backend
``triton`` of ``swiglu_mlp``: ``swiglu_mlp_linear``'s three GEMMs with this SwiGLU between them).

``swiglu_clamp_triton(gate, up, limit, out_dtype)``: one elementwise pass, silu(min(gate, limit)) *
clamp(up, -limit, limit), reading gate and up in their dtype and writing ``out_dtype`` (fp32 for the op; the shared
expert asks for its weights' dtype, so the down projection's input is written once, already rounded). The
reference is a chain of eight torch kernels over fp32 [T, I] tensors (two clamps, neg, exp, add, div, mul, the
cast): about 1 ms per 4 layers of an 8K prefill at V4's I = 2048.

Numerics follow the reference formula for formula: x / (1 + exp(-x)) with libdevice's ``expf`` (what torch's fp32
``exp`` calls; Triton's ``tl.exp`` is the approximate ``ex2``) and an IEEE division (``div_rn``: Triton's fp32
``/`` compiles to the approximate ``div.full``), each product and sum rounded on its own (no FMA contraction):
bit-identical to the reference on the GPU. The interpreter has no libdevice (numpy's exp there: within an ulp).
Elementwise: batch-invariant.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import interpreting, pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

from .reference import swiglu_clamp_ref
from .swiglu_linear import swiglu_mlp_gemms

BLOCK = 2048  # elements per program


@triton.jit
def _swiglu_kernel(
    gate_ptr, up_ptr, out_ptr, n, limit, C, g_stride, u_stride,
    HAS_LIMIT: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr, STRIDED: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """out (contiguous, n elements) from gate and up; STRIDED: [n / C, C] rows of row strides g_stride / u_stride
    (the halves of one GEMM's output), else contiguous."""
    pdl_prologue(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    gi = i
    ui = i
    if STRIDED:
        gi = (i // C) * g_stride + i % C
        ui = (i // C) * u_stride + i % C
    g = tl.load(gate_ptr + gi, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + ui, mask=m, other=0.0).to(tl.float32)
    if HAS_LIMIT:  # NaN stays NaN, as in torch.clamp
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    y = tl.math.div_rn(g, 1.0 + e) * u
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> tuple[int, int] | None:
    """(columns, row stride) of a tensor whose rows are contiguous and evenly spaced (a 2-D view of halves of a
    wider row), else None."""
    if t.dim() != 2 or t.stride(1) != 1:
        return None
    return t.shape[1], t.stride(0)


def swiglu_clamp_triton(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``swiglu_clamp`` in one launch, written in ``out_dtype`` (the op returns fp32; see the module docstring).
    gate and up may be column slices of one [T, 2 I] tensor (read in place) or any contiguous tensors."""
    require_same_device(gate, up)
    strided = not (gate.is_contiguous() and up.is_contiguous())
    cols, gs, us = gate.shape[-1] if gate.dim() else 1, 0, 0
    if strided:
        g_rows, u_rows = _rows(gate), _rows(up)
        if g_rows is None or u_rows is None:
            gate, up, strided = gate.contiguous(), up.contiguous(), False
        else:
            gs, us = g_rows[1], u_rows[1]
    out = torch.empty(gate.shape, dtype=out_dtype, device=gate.device)
    n = out.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](
            gate, up, out, n, float(limit) if limit is not None else 0.0, cols, gs, us,
            HAS_LIMIT=limit is not None, LIBDEVICE=not interpreting(), BLOCK=BLOCK, STRIDED=strided,
            num_warps=8, enable_fp_fusion=False, **pdl_options(gate.device),
        )  # fmt: skip
    return out


def _swiglu_clamp_backend(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if not (gate.is_floating_point() and up.is_floating_point()):
        return swiglu_clamp_ref(gate, up, limit, out_dtype)
    return swiglu_clamp_triton(gate, up, limit, out_dtype)


def swiglu_mlp_triton(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, *, swiglu_limit: float | None
) -> torch.Tensor:
    """The shared expert as ``swiglu_mlp_linear`` with the SwiGLU in one launch that writes the down projection's
    input in the weights' dtype (the reference rounds its fp32 result there too)."""
    return swiglu_mlp_gemms(
        x, w1, w3, w2, swiglu_limit, lambda g, u, limit: swiglu_clamp_triton(g, u, limit, out_dtype=x.dtype)
    )


register_backend(
    "swiglu_clamp", "triton", _swiglu_clamp_backend, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip
register_backend(
    "swiglu_mlp", "triton", swiglu_mlp_triton, devices=("cuda",), priority=30,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip
