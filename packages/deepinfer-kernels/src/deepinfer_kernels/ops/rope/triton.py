"""Triton interleaved RoPE: one launch per call, any number of middle dims (CUDA backend ``triton``).

Layout: x [T, ..., D] is viewed as [T, H, D] (H = product of the middle dims, 1 for [T, D]) with a contiguous
last dim (a copy only when the middle dims cannot be flattened); the output is a new contiguous tensor or
``out`` (any strides that view as [T, H, D]). With ``out=x`` the kernel runs in place and skips the D - R
leading channels. A program owns a [BLOCK_T, BLOCK_H] tile of rows: it copies the D - R leading channels, computes
cos / sin of ``float(position) * inv_freq`` once per token (shared by the tile's heads) and rotates the
adjacent pairs of the trailing R channels in fp32.

Numerics follow the reference formula for formula: the angle is one fp32 product, cos / sin are libdevice's
``__nv_cosf`` / ``__nv_sinf`` (the accurate CUDA math library functions that torch's fp32 ``cos`` / ``sin``
call; Triton's own ``tl.cos`` / ``tl.sin`` are not promised to be those), and the kernel is compiled without
FMA contraction (``enable_fp_fusion=False``) and without libdevice's flush-to-zero variants, so
``a * cos - b * sin`` is rounded after each product and after the difference, as the reference's separate
torch ops are. Measured on an H200 (torch 2.11+cu130, triton 3.6): bit-identical to the reference at every
V4 call-site shape in bf16 and fp32, forward and inverse, positions up to 1,000,000 with plain and YaRN
inv_freq (``test_gpu_bitwise_vs_reference`` keeps it so; the other tests enforce the looser contract:
pass-through channels bitwise, fp32 relative error <= 1e-6, bf16 within 1 ulp).

Every element is computed from its own pair, its token's position and inv_freq only, and the tile sizes
depend on (H, D) alone: batch-invariant. Importing this module registers the backend; it needs triton (the
op's ``__init__`` guards the import). CPU tensors run in Triton's interpreter when TRITON_INTERPRET=1 (tests
only; the interpreter uses ``tl.cos`` / ``tl.sin``, numpy's there, ~1 fp32 ulp off torch's CPU cos / sin, and its
fp32 -> bf16 cast truncates: 1 bf16 ulp).
"""

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import interpreting, pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

TILE_ELEMS = 4096  # elements of x per program (rows x padded D); sets BLOCK_T x BLOCK_H from (H, D)
MAX_NOPE_BLOCK = 1024  # widest chunk of pass-through channels copied at once


@triton.jit
def rope_cos_sin(angle, LIBDEVICE: tl.constexpr):
    """cos / sin of fp32 angles as every RoPE kernel takes them: libdevice's (torch's) on the GPU, Triton's own in
    the CPU interpreter (which has no libdevice)."""
    if LIBDEVICE:
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    return cos, sin


@triton.jit
def rotate_pairs(a, b, cos, sin):
    """Adjacent pairs (a, b) -> (a cos - b sin, b cos + a sin), joined back into pairs (the caller compiles without
    FMA contraction, so each product and difference rounds on its own, as in the reference)."""
    return tl.join(a * cos - b * sin, b * cos + a * sin)


@triton.jit
def rope_tail_rows(
    v, pos, freq_ptr, D, HALF, INVERSE: tl.constexpr, LIBDEVICE: tl.constexpr, M: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
    """For another kernel's epilogue: rows v [M, BLOCK_D] fp32 of D channels (D - 2 * HALF even), all at position
    ``pos`` (a scalar), with their trailing 2 * HALF channels rotated as ``_rope_kernel`` rotates them (the same
    angle, cos / sin and order of operations, each product and sum rounded on its own: ``mul_rn`` / ``add_rn`` /
    ``sub_rn`` where the caller compiles with FMA contraction; the interpreter's plain ops contract nothing) and the
    others unchanged."""
    a, b = tl.split(tl.reshape(v, [M, BLOCK_D // 2, 2]))
    j = tl.arange(0, BLOCK_D // 2) - (D - 2 * HALF) // 2  # pair index within the rotated tail
    tail = (j >= 0) & (j < HALF)
    inv = tl.load(freq_ptr + j, mask=tail, other=0.0)
    angle = pos.to(tl.float32) * inv
    if LIBDEVICE:  # one rounded product, never contracted into what reads it
        angle = libdevice.mul_rn(tl.broadcast_to(pos.to(tl.float32), inv.shape), inv)
    cos, sin = rope_cos_sin(angle, LIBDEVICE)
    if INVERSE:
        sin = -sin
    cos = cos[None, :]
    sin = sin[None, :]
    if LIBDEVICE:
        ra = libdevice.sub_rn(libdevice.mul_rn(a, cos), libdevice.mul_rn(b, sin))
        rb = libdevice.add_rn(libdevice.mul_rn(b, cos), libdevice.mul_rn(a, sin))
    else:
        ra = a * cos - b * sin
        rb = b * cos + a * sin
    keep = tail[None, :]
    return tl.reshape(tl.join(tl.where(keep, ra, a), tl.where(keep, rb, b)), [M, BLOCK_D])


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, freq_ptr, y_ptr,
    T, H, D, HALF, x_stride_t, x_stride_h, y_stride_t, y_stride_h,
    INVERSE: tl.constexpr, LIBDEVICE: tl.constexpr, COPY_NOPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    t_ok = t < T
    row_ok = (t_ok[:, None] & (h < H)[None, :])[:, :, None]  # [BLOCK_T, BLOCK_H, 1]
    x_row = (x_ptr + t[:, None] * x_stride_t + h[None, :] * x_stride_h)[:, :, None]
    y_row = (y_ptr + t[:, None] * y_stride_t + h[None, :] * y_stride_h)[:, :, None]

    # the leading D - R channels pass through unchanged (already in place when y is x)
    nope = D - 2 * HALF
    if COPY_NOPE:
        c = tl.arange(0, BLOCK_NOPE)[None, None, :]
        for c0 in range(0, nope, BLOCK_NOPE):
            m = row_ok & (c0 + c < nope)
            tl.store(y_row + c0 + c, tl.load(x_row + c0 + c, mask=m), mask=m)

    # angle = float(position) * inv_freq in fp32, cos / sin once per token
    j = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.float32)
    inv = tl.load(freq_ptr + j, mask=j < HALF, other=0.0)
    cos, sin = rope_cos_sin(pos[:, None] * inv[None, :], LIBDEVICE)  # [BLOCK_T, BLOCK_HALF]
    if INVERSE:
        sin = -sin
    cos = cos[:, None, :]
    sin = sin[:, None, :]

    # the trailing R channels as adjacent pairs (a, b) -> (a cos - b sin, b cos + a sin)
    r = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
    m = row_ok & (r < 2 * HALF)
    v = tl.load(x_row + nope + r, mask=m, other=0.0).to(tl.float32)
    a, b = tl.split(tl.reshape(v, [BLOCK_T, BLOCK_H, BLOCK_HALF, 2]))
    out = tl.reshape(rotate_pairs(a, b, cos, sin), [BLOCK_T, BLOCK_H, 2 * BLOCK_HALF])
    tl.store(y_row + nope + r, out.to(y_ptr.dtype.element_ty), mask=m)


def _config(h: int, d: int, half: int, in_place: bool) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_NOPE, BLOCK_HALF) from (H, D, R/2) only: never from T. In place a row is its R
    trailing channels only."""
    row = triton.next_power_of_2(2 * half if in_place else d)
    block_h = min(triton.next_power_of_2(h), max(1, TILE_ELEMS // row))
    block_t = max(1, TILE_ELEMS // (row * block_h))
    block_nope = min(triton.next_power_of_2(max(d - 2 * half, 1)), MAX_NOPE_BLOCK)
    return block_t, block_h, block_nope, triton.next_power_of_2(half)


def _rows(t: torch.Tensor, h: int) -> torch.Tensor | None:
    """t [T, ..., D] as a [T, H, D] view with a contiguous last dim, or None when no such view exists."""
    try:
        v = t.view(t.shape[0], h, t.shape[-1])
    except RuntimeError:
        return None
    return v if v.stride(-1) == 1 else None


def rope_interleaved_triton(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rope_interleaved`` in one Triton launch (see the module docstring for numerics). With ``out=x`` only the
    trailing R channels are read and written."""
    if x.dim() < 2:
        raise ValueError(f"rope triton: x must be [T, ..., D], got {tuple(x.shape)}")
    t, d, half = x.shape[0], x.shape[-1], inv_freq.shape[0]
    freq = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    require_same_device(x, positions, freq)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if y.numel() == 0:
        return y
    if half == 0:
        return y if y is x else y.copy_(x)
    h = math.prod(x.shape[1:-1])
    y3 = _rows(y, h)
    if y3 is None:  # an out without a [T, H, D] view: compute into a fresh tensor, then copy
        return y.copy_(rope_interleaved_triton(x, positions, inv_freq, inverse))
    in_place = y is x
    x3 = y3 if in_place else _rows(x, h)
    if x3 is None:
        x3 = x.reshape(t, h, d).contiguous()
    block_t, block_h, block_nope, block_half = _config(h, d, half, in_place)
    grid = (triton.cdiv(t, block_t), triton.cdiv(h, block_h))
    _rope_kernel[grid](
        x3, positions.contiguous(), freq, y3, t, h, d, half, x3.stride(0), x3.stride(1), y3.stride(0), y3.stride(1),
        INVERSE=bool(inverse), LIBDEVICE=not interpreting(), COPY_NOPE=not in_place,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_NOPE=block_nope, BLOCK_HALF=block_half,
        num_warps=4, enable_fp_fusion=False, enable_reflect_ftz=False, **pdl_options(x3.device),
    )  # fmt: skip
    return y


register_backend(
    "rope_interleaved", "triton", rope_interleaved_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip
