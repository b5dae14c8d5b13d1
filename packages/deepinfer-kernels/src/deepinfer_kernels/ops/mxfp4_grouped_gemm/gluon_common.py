"""What the Gluon MXFP4 kernels (``gluon.py``, ``gluon_wgmma.py``) share.

* E2M1 -> bf16: packed bytes and their block scales to two bf16 tensors (low and high nibbles) in the registers
  that hold them, by bit moves in inline PTX (4 bytes -> 8 values in 14 integer ops): sign to bit 15, the 3
  magnitude bits to bits 6..8 make the bf16 2^-126 * value (0.5 is a bf16 subnormal), then two exact bf16
  multiplies, by 2^126 and by the block's scale 2^(s-127). Scale bytes 0 and 255 are outside what the multiply
  honours (the block becomes zero / inf instead of 2^-127 / NaN). With FOLD (where ``fold_ok``: every scale byte
  at most 128, as in every MXFP4 checkpoint) one multiply by 2^(s-1) does both: the same exact products, a
  quarter fewer instructions in the unpack.
* The same from int32 words (``load_words``, ``unpack_words``): a kernel that carries loaded weights across loop
  steps (prefetch) holds a uint8 tensor one byte a register and repacks every byte; a word is one register.
* The weight rows of a program, with the fused gate/up interleave (``expert_weight_rows``), and the epilogue of
  the wgmma kernels' swapped accumulators (``store_swapped``)."""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from deepinfer_kernels.ops.grouped_gemm.triton import expert_epilogue

# $4: 4 packed bytes; $5, $6: 4 bf16 scales (two per register) -> $0 $1: the 4 low nibbles, $2 $3: the 4 high
# nibbles, as bf16 pairs. t = [0, b0, 0, b1] puts a low nibble's magnitude 2 bits above bits 6..8 and its sign 4
# below bit 15; a high nibble's magnitude 6 above, its sign already at 15 (masked: bit 8 of t is a low-nibble bit).
_BITS = """.reg .b32 t, a, b;
prmt.b32 t, $4, 0, 0x1404;
shr.b32 a, t, 2; shl.b32 b, t, 4; lop3.b32 $0, a, b, 0x81C081C0, 0xA8;
shr.b32 a, t, 6; and.b32 b, t, 0x80008000; lop3.b32 $2, a, b, 0x01C001C0, 0xEC;
prmt.b32 t, $4, 0, 0x3424;
shr.b32 a, t, 2; shl.b32 b, t, 4; lop3.b32 $1, a, b, 0x81C081C0, 0xA8;
shr.b32 a, t, 6; and.b32 b, t, 0x80008000; lop3.b32 $3, a, b, 0x01C001C0, 0xEC;
"""
_TIMES_2_126 = """mov.b32 a, 0x7E807E80;
mul.rn.bf16x2 $0, $0, a; mul.rn.bf16x2 $1, $1, a; mul.rn.bf16x2 $2, $2, a; mul.rn.bf16x2 $3, $3, a;
"""
_TIMES_SCALE = """mul.rn.bf16x2 $0, $0, $5; mul.rn.bf16x2 $1, $1, $6;
mul.rn.bf16x2 $2, $2, $5; mul.rn.bf16x2 $3, $3, $6;
"""
_UNPACK_SCALED = gl.constexpr("{\n" + _BITS + _TIMES_2_126 + _TIMES_SCALE + "}")
# The same with the 2^126 folded into the scale (one multiply a pair instead of two): ``scale`` is then 2^(s-1), a
# normal bf16 only for scale bytes s <= 128 (``fold_ok``); the products are the same exact values, so the bits
# match the two-multiply form wherever both apply.
_UNPACK_FOLDED = gl.constexpr("{\n" + _BITS + _TIMES_SCALE + "}")


@gluon.jit
def unpack_scaled(packed, scale, FOLD: gl.constexpr = False):
    """(low nibbles, high nibbles) of uint8 ``packed`` as bf16 E2M1 values times the bf16 ``scale`` (same shape);
    FOLD: ``scale`` already holds the 2^126 of the subnormal-safe bit placement (``scale_bits``)."""
    return gl.inline_asm_elementwise(
        _UNPACK_FOLDED if FOLD else _UNPACK_SCALED, "=r,=r,=r,=r,r,r,r", [packed, scale],
        dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4,
    )  # fmt: skip


@gluon.jit
def _multiplier_bits(s, FOLD: gl.constexpr):
    """uint8 block scale bytes s -> int32 bf16 bits of the unpack's multiplier: 2^(s-127), or with FOLD 2^(s-1)
    (2^126 folded in; valid for s <= 128)."""
    e = s.to(gl.int32) & 0xFF
    if FOLD:
        e = e + 126
    return e << 7


@gluon.jit
def scale_bits(s, FOLD: gl.constexpr = False):
    """uint8 block scale bytes s -> the bf16 multiplier (``_multiplier_bits``)."""
    return _multiplier_bits(s, FOLD).to(gl.int16).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _bf16_halves(pair):
    """int32 bf16 pairs -> (low halves, high halves) as bf16: register moves only."""
    return gl.inline_asm_elementwise(
        "mov.b32 {$0, $1}, $2;", "=h,=h,r", [pair], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1
    )


@gluon.jit
def _bytes_order(p01, p23):
    """Two [rows, W] int32 tensors of bf16 pairs (values of bytes 0, 1 and 2, 3 of each word) -> [rows, 4 W] bf16
    in byte order (4 w + b)."""
    v0, v1 = _bf16_halves(p01)
    v2, v3 = _bf16_halves(p23)
    t = gl.join(gl.join(v0, v2), gl.join(v1, v3))  # [rows, W, 2, 2]: (w, j, i) holds byte 2 j + i
    return gl.reshape(t, [t.shape[0], 4 * t.shape[1]])


@gluon.jit
def load_words(w_rows, s_rows, k0, kw):
    """(packed words, scale bytes) of packed bytes k0 + 4 kw .. + 3 (k0 a multiple of 16) of the weight rows at
    ``w_rows`` (byte row pointers, 4-byte aligned; ``s_rows`` their scale rows), [rows, BKH / 4] int32 words and
    their scale bytes, in kw's parent layout: a word is one register (a uint8 tensor holds a byte a register)."""
    wp = (w_rows + k0).to(gl.pointer_type(gl.int32), bitcast=True)
    words = gl.load(wp[:, None] + kw[None, :])
    s = gl.load(s_rows[:, None] + (k0 // 16 + kw // 4)[None, :])  # equal addresses in a thread are merged
    return words, s


@gluon.jit
def unpack_words(words, s, FOLD: gl.constexpr = False):
    """``load_words``' words as (low nibbles, high nibbles) in bf16, [rows, BKH] each, byte order (FOLD: as
    ``unpack_scaled``)."""
    b = _multiplier_bits(s, FOLD)
    pair = b | (b << 16)  # the word's four bytes share a block: one scale pair for both halves
    l01, l23, h01, h23 = gl.inline_asm_elementwise(
        _UNPACK_FOLDED if FOLD else _UNPACK_SCALED, "=r,=r,=r,=r,r,r,r", [words, pair, pair], dtype=(gl.int32,) * 4,
        is_pure=True, pack=1,
    )  # fmt: skip
    return _bytes_order(l01, l23), _bytes_order(h01, h23)


@gluon.jit
def load_unpacked(w_rows, s_rows, k0, kh, FOLD: gl.constexpr = False):
    """Packed byte columns k0 + kh of the weight rows at ``w_rows`` (row pointers; ``s_rows`` their scale rows, a
    byte per 16 packed bytes) as (low nibbles, high nibbles) in bf16, [rows, BKH] each in kh's parent layout.
    FOLD: one multiply a pair (callers pass it only where ``fold_ok`` holds for the scales)."""
    packed = gl.load(w_rows[:, None] + (k0 + kh)[None, :])
    s = gl.load(s_rows[:, None] + ((k0 + kh) // 16)[None, :])  # equal addresses in a thread are merged
    return unpack_scaled(packed, scale_bits(s, FOLD), FOLD)


FOLD_MAX_SCALE = 128  # the largest scale byte whose folded multiplier 2^(s-1) is a finite bf16
# Unpack with one bf16 multiply a weight pair (the scale as 2^(s-1)) in every Gluon MXFP4 kernel where the scale
# bytes allow it (``fold_ok``): the same bits as two multiplies. Off until its GPU test
# (``test_gpu_fold_gives_the_same_bits``) and a timed A/B have run (session 40: no device left for them). Why it
# should pay: on the H200 the decode kernel runs at 55-59% of copy and only ~10% faster than on the H100 (1267
# against 1393 us, V4.1 gate/up at 64 tokens), so it is bound by its instructions, and the unpack is most of them
# (22 of ~26 a 4-byte word; this takes 4 of the 22 away).
FOLD = False


def fold_ok(w_scale: torch.Tensor) -> bool:
    """Whether every block scale byte of ``w_scale`` is at most FOLD_MAX_SCALE (block scales up to 2, as every
    MXFP4 checkpoint's weights have), so the kernels may unpack with one multiply a pair. Read once per tensor and
    version (one device sync: the weights are loaded once, then read by every step) and kept on the tensor; a
    tensor first met inside a CUDA graph capture, where no sync may run, takes the two-multiply form."""
    memo = getattr(w_scale, "_deepinfer_fold_ok", None)
    if memo is not None and memo[0] == w_scale._version:
        return memo[1]
    if w_scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    ok = bool((w_scale.view(torch.uint8) <= FOLD_MAX_SCALE).all())
    w_scale._deepinfer_fold_ok = (w_scale._version, ok)
    return ok


def fold_for(w_scale: torch.Tensor) -> bool:
    """The FOLD constexpr of a launch over ``w_scale``."""
    return FOLD and fold_ok(w_scale)


@gluon.jit
def relabel_k(t):
    """[M, BKH] -> [M, BKH]: column 32c + 8q + 2a + b to 32c + 8a + 2q + b (a layout change only, no data moves)."""
    m: gl.constexpr = t.shape[0]
    kk: gl.constexpr = t.shape[1]
    return gl.reshape(gl.permute(gl.reshape(t, [m, kk // 32, 4, 4, 2]), [0, 1, 3, 2, 4]), [m, kk])


@gluon.constexpr_function
def weight_load_layout(num_warps, k_width):
    """Registers of a weight tile as the wgmma kernels load it: the ``mma.sync`` A operand layout (a warp's 16 rows,
    ``k_width`` consecutive elements a thread: 8 uint8 bytes, or 2 int32 words of 4), which ``relabel_k`` maps onto
    wgmma's register A operand without moving data."""
    mma2 = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    return gl.DotOperandLayout(operand_index=0, parent=mma2, k_width=k_width)


@gluon.jit
def expert_weight_rows(w_ptr, s_ptr, e, j, pid_n, N_OUT, K, BLOCK_N: gl.constexpr, FUSE: gl.constexpr):
    """(first output column n0, weight row pointers, scale row pointers) of program column pid_n's BLOCK_N tile rows
    ``j`` (an arange in the operand's row layout) of expert e. FUSE: tile row j = 16 w + 8 h + g is output column
    n0 + 8 w + g of the gate (h = 0) or up (h = 1) rows: an MMA thread owns rows g and g + 8 of its warp's 16, so a
    column's gate and up sums meet in one thread's registers, and a program holds one accumulator and one weight
    tile (as the down GEMM). Rows past N_OUT recompute the last one (never stored)."""
    KH = K // 2
    KS = K // 32
    if FUSE:
        n0 = pid_n * (BLOCK_N // 2)
        col = gl.minimum(n0 + 8 * (j // 16) + j % 8, N_OUT - 1).to(gl.int64)
        rn = col + ((j // 8) % 2).to(gl.int64) * N_OUT
    else:
        n0 = pid_n * BLOCK_N
        rn = gl.minimum(n0 + j, N_OUT - 1).to(gl.int64)
    n_rows = 2 * N_OUT if FUSE else N_OUT
    return n0, w_ptr + e * n_rows * KH + rn * KH, s_ptr + e * n_rows * KS + rn * KS


@gluon.jit
def store_swapped(acc, EPI: gl.constexpr, out_ptr, rs_ptr, n0, r0, r1, N_OUT, limit,
                  FUSE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_RS: gl.constexpr):  # fmt: skip
    """Epilogue of a swapped [BLOCK_N, TN] accumulator (weight rows x the tile's x rows r0 + c, c < r1 - r0), in
    layout EPI: with FUSE, gate and up rows interleaved by 8 within each 16 (``expert_weight_rows``) are split into
    the two halves of the clamped SwiGLU; output columns n0 .. of out [R, N_OUT]."""
    BLOCK_N: gl.constexpr = acc.shape[0]
    TN: gl.constexpr = acc.shape[1]
    if FUSE:
        g, u = gl.permute(gl.reshape(acc, [BLOCK_N // 16, 2, 8, TN]), [0, 2, 3, 1]).split()
        acc_g = gl.convert_layout(gl.reshape(g, [BLOCK_N // 2, TN]), EPI)
        acc_u = gl.convert_layout(gl.reshape(u, [BLOCK_N // 2, TN]), EPI)
    else:
        acc_g = gl.convert_layout(acc, EPI)
        acc_u = acc_g
    out_rows = (r0 + gl.arange(0, TN, layout=gl.SliceLayout(0, EPI))).to(gl.int64)
    row_ok = out_rows < r1
    rs = 1.0
    if HAS_RS:
        rs = gl.load(rs_ptr + out_rows, mask=row_ok, other=0.0).to(gl.float32)[None, :]
    y = expert_epilogue(acc_g, acc_u, rs, FUSE, HAS_LIMIT, limit, HAS_RS)  # a triton.jit helper: Gluon calls it
    ro = n0 + gl.arange(0, acc_g.shape[0], layout=gl.SliceLayout(1, EPI))
    gl.store(out_ptr + out_rows[None, :] * N_OUT + ro[:, None], y.to(out_ptr.dtype.element_ty),
             mask=(ro < N_OUT)[:, None] & row_ok[None, :])  # fmt: skip
