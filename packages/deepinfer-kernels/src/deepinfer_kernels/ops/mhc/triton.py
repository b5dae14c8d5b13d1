"""Triton mHC (CUDA backend ``triton``): coefficients, hc_head weights, collapse and expand.

``mhc_coefficients`` / ``mhc_head_weights`` are two launches whatever T is:

1. ``_mixes_partial_kernel``: the flattened K = n*d input of a token is cut into SPLIT fixed chunks of
   CHUNK columns; program (s, tile) takes chunk s of BLOCK_T tokens and writes, per token, the partial
   mixes ``x[chunk] @ fn[:, chunk]^T`` (fp32 accumulation) and the partial sum of squares into an fp32
   workspace [SPLIT, T, NPAD] (the sum of squares sits in column ROWS). The norm factors out of the matmul
   (m = (flat @ fn^T) * rsqrt(mean(flat^2) + eps)), so nothing waits for the statistic. fn stays fp32: bf16
   x meets it as three bf16 parts (hi + mid + lo carry fn's 24-bit significand; bf16 x bf16 products are
   exact in fp32; one accumulator per part, added as hi + (mid + lo) at the end), other dtypes as IEEE fp32
   products (no TF32), so the mixes agree with the fp32 reference to fp32 rounding.
2. ``_coefficients_epilogue_kernel``, one program per token: loads the token's SPLIT partials in one go, adds
   them by one fixed tree over the split axis, applies the rsqrt and the whole epilogue in registers: sigmoid
   pre / post (or the head's sigmoid), then softmax + hc_eps and Sinkhorn (one column pass, then iters - 1 row
   and column passes, hc_eps in every divide) on the n x n comb, exactly as ``reference.py`` orders it.

SPLIT, CHUNK, BLOCK_T, BLOCK_K and the warp counts depend on K alone, T is not specialised, and the split
partials are added in a fixed order, so a token's bits never depend on T or on the other tokens:
batch-invariant by construction (the GPU tests check one token alone against the same token inside 7, 64
and 4096). The order differs from the reference's (16-row tiled GEMM after the norm), so results match it
to fp32 rounding (~1e-6 relative), not bitwise.

At decode sizes the cost is latency, not bytes: each BLOCK_K step of the mixes kernel waits on its loads
(about 1 us on an H200), and the 20 Sinkhorn rounds of the epilogue run on a single warp, so a sublayer's mHC
work stays far above its byte floor at T = 1 (see ``benchmarks/bench_mhc.py``).

Backend ``triton_adaptive`` (the default outside batch-invariant mode) runs calls of at most ADAPTIVE_MAX_TOKENS
tokens with tilings for their size (shorter chunks and token tiles, ``ADAPTIVE_MIX``): a token's bits then depend
on which tier T falls in, so it is not registered batch-invariant.

``mhc_collapse`` / ``mhc_expand``: one program per (token, BLOCK_D columns), fp32 arithmetic, one cast at the
store; purely elementwise per token, hence batch-invariant too. ``mhc_expand_collapse``: the expand kernel, each
program also collapsing the streams it stores (their rounded values, ``_collapsed``'s order): the two kernels' bits.
``mhc_collapse_rms_norm``: one program per token, the collapse then the RMSNorm with ``rms_norm``'s tiling (for bf16
streams bitwise the two ops in a row).
``mhc_pre_collapse_rms_norm``: the mixes of the n pre rows (kernel 1 above, as ``mhc_head_weights``), then one
program per token that makes pre from its partials (the epilogue's arithmetic, ``_site_logits``) and the collapse
+ RMSNorm with it; batch-invariant with the invariant tiling, like the other two-launch ops.

Importing this module registers the backends; it needs triton (the op's ``__init__`` guards the import).
CPU tensors run in Triton's interpreter when TRITON_INTERPRET=1 (tests only; registered for "cuda").
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import interpreting, pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.ops.rms_norm.triton import inv_rms, norm_config
from deepinfer_kernels.registry import register_backend

# Mixes: K columns per split (fixes each token's reduction order), tokens and columns per program step. Chosen
# on an H200 (bf16, d = 4096 / 5120): fewer, longer splits are faster for prefill (T = 8192: CHUNK 2048 about
# 20% below 512) and slower for decode (T = 1: each BLOCK_K step costs about 1 us of latency); 512 / 128 / 64
# is the best compromise of the configurations measured (see benchmarks/bench_mhc.py).
CHUNK = 512
BLOCK_T = 128
BLOCK_K = 64
MIX_WARPS = 8
MIX_STAGES = 3
# Backend ``triton_adaptive`` (not batch-invariant): (at most this many tokens, tiling), first match; larger calls
# take the invariant configuration. 256-column chunks give twice the invariant split's programs with half the
# dependent steps each, and token tiles no larger than T keep the tensor cores' work to the live rows. H200, n = 4,
# d = 4096 / 5120: up to 16 tokens 14.1 -> 9.1 us for the coefficients (session 8); at 64 tokens the mixes 9.5 ->
# 3.7-5.2 us and a whole sublayer's mHC in a graph 21.6 -> 17.8 / 21.8 -> 19.3 us (session 11). At 256 tokens the
# twice as many partials cost the per-token epilogue more than the shorter chunks save (27.0 -> 30.1 us), so the
# tiers stop at 64.
ADAPTIVE_MIX = (
    (16, {"CHUNK": 256, "BLOCK_T": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}),
    (32, {"CHUNK": 256, "BLOCK_T": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}),
    (64, {"CHUNK": 256, "BLOCK_T": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}),
)
ADAPTIVE_MAX_TOKENS = ADAPTIVE_MIX[-1][0]
EPI_WARPS = 1  # one token per epilogue program
BLOCK_D = 1024  # columns per collapse / expand program
ELEM_WARPS = 4


@triton.jit(do_not_specialize=["T"])
def _mixes_partial_kernel(
    x_ptr, fn_ptr, ws_ptr, T, K,
    ROWS: tl.constexpr, NPAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_FN: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    pid_s = tl.program_id(0)
    tok = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = tok < T
    r = tl.arange(0, NPAD)
    r_ok = r < ROWS
    kb = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, NPAD), dtype=tl.float32)  # x @ fn^T, or x @ hi^T when fn is split
    acc_mid = tl.zeros((BLOCK_T, NPAD), dtype=tl.float32)  # x @ mid^T
    acc_lo = tl.zeros((BLOCK_T, NPAD), dtype=tl.float32)  # x @ lo^T
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    k_lo = pid_s * CHUNK
    for k0 in range(k_lo, tl.minimum(k_lo + CHUNK, K), BLOCK_K):
        kk = k0 + kb
        k_ok = kk < K
        xv = tl.load(x_ptr + tok[:, None] * K + kk[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(fn_ptr + r[:, None] * K + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        xf = xv.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        if SPLIT_FN:  # bf16 x: fn = hi + mid + lo to fp32 precision (each step below is exact in fp32)
            hi = w.to(tl.bfloat16)
            rem = w - hi.to(tl.float32)
            mid = rem.to(tl.bfloat16)
            lo = (rem - mid.to(tl.float32)).to(tl.bfloat16)
            if F32_DOT:  # the CPU interpreter, whose bf16 dot is wrong: the same exact products in fp32
                acc = tl.dot(xf, tl.trans(hi.to(tl.float32)), acc, input_precision="ieee")
                acc_mid = tl.dot(xf, tl.trans(mid.to(tl.float32)), acc_mid, input_precision="ieee")
                acc_lo = tl.dot(xf, tl.trans(lo.to(tl.float32)), acc_lo, input_precision="ieee")
            else:
                acc = tl.dot(xv, tl.trans(hi), acc)
                acc_mid = tl.dot(xv, tl.trans(mid), acc_mid)
                acc_lo = tl.dot(xv, tl.trans(lo), acc_lo)
        else:
            acc = tl.dot(xf, tl.trans(w), acc, input_precision="ieee")
    if SPLIT_FN:
        acc = acc + (acc_mid + acc_lo)
    acc = tl.where(r[None, :] == ROWS, sq[:, None], acc)  # column ROWS carries the sum of squares
    dst = ws_ptr + (pid_s.to(tl.int64) * T + tok[:, None]) * NPAD + r[None, :]
    tl.store(dst, acc, mask=t_ok[:, None])


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _site_logits(
    ws_ptr, base_ptr, scale_ptr, tok, T, K, norm_eps,
    N: tl.constexpr, NP: tl.constexpr, RB: tl.constexpr, NPAD: tl.constexpr, SPLIT: tl.constexpr,
    SP2: tl.constexpr, COMB: tl.constexpr,
):  # fmt: skip
    """One token's logits z = m * scale + base from its SPLIT partial mixes: the workspace row [pre n | post n |
    comb n*n | sum of squares] viewed as an [RB, NP] tile of rows of n (row 0 pre, row 1 post, rows 2..n+1 the comb
    rows j (columns k), the sum of squares at (n + 2, 0); the head / pre alone (COMB=False): row 0 pre, the sum of
    squares at (1, 0)). Returns (z, r, c, off, val): the tile, its row and column indices, each entry's column in
    the workspace row / base / outputs, and which entries are logits."""
    r = tl.arange(0, RB)[:, None]
    c = tl.arange(0, NP)[None, :]
    off = r * N + c
    R_SQ: tl.constexpr = 2 + N if COMB else 1
    val = (c < N) & (r < R_SQ)
    sq_at = (r == R_SQ) & (c == 0)
    # all SPLIT partials at once (one load), added by one fixed tree over the split axis (batch-invariant)
    s = tl.arange(0, SP2)[:, None, None]
    part = tl.load(
        ws_ptr + (s * T + tok) * NPAD + off[None, :, :], mask=(s < SPLIT) & (val | sq_at)[None, :, :], other=0.0
    )
    m = tl.sum(part, axis=0)  # [RB, NP]
    sq = tl.sum(tl.sum(tl.where(sq_at, m, 0.0), axis=1), axis=0)
    m = m * (1.0 / tl.sqrt_rn(sq / K + norm_eps))  # RMSNorm of the flattened streams, applied to the mixes
    z = m * tl.load(scale_ptr + tl.minimum(r, 2 if COMB else 0)) + tl.load(base_ptr + off, mask=val, other=0.0)
    return z, r, c, off, val


@triton.jit(do_not_specialize=["T"])
def _coefficients_epilogue_kernel(
    ws_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
    T, K, norm_eps, hc_eps, iters,
    N: tl.constexpr, NP: tl.constexpr, RB: tl.constexpr, NPAD: tl.constexpr, SPLIT: tl.constexpr,
    SP2: tl.constexpr, COMB: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One token (``_site_logits`` for the workspace's layout): pre, and with COMB post and the Sinkhorn comb."""
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    z, r, c, off, val = _site_logits(
        ws_ptr, base_ptr, scale_ptr, tok, T, K, norm_eps, N, NP, RB, NPAD, SPLIT, SP2, COMB
    )  # fmt: skip
    pre = _sigmoid(z) + hc_eps
    tl.store(pre_ptr + tok * N + c + 0 * r, pre, mask=val & (r == 0))
    if COMB:
        tl.store(post_ptr + tok * N + c + 0 * r, 2.0 * _sigmoid(z), mask=val & (r == 1))
        # comb logits L[j, k] on rows 2..n+1; softmax over k, then Sinkhorn with hc_eps in every divide
        cm = val & (r >= 2)
        logits = tl.where(cm, z, -1e30)
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = tl.where(cm, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # columns (sum over j)
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)  # rows (sum over k)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + tok * (N * N) + off - 2 * N, comb, mask=cm)


@triton.jit
def _collapsed(
    x_ptr, w, t, D, cols, N: tl.constexpr, OUT_DTYPE: tl.constexpr, r, c, FROM_TILE: tl.constexpr
):  # fmt: skip
    """sum_j w[t, j] * x[t, j, cols] in fp32 (j in order), rounded to OUT_DTYPE and read back as fp32; 0 past D.
    ``w`` points at the [T, n] weights, or with FROM_TILE is an [RB, NP] register tile (``_site_logits``'s layout,
    rows / columns ``r`` / ``c``) whose row 0 holds token t's weights, each picked out by a sum of zeros and itself
    (exact): the same products. The collapse kernels make their rows with it (rounding again at the store changes
    no bit)."""
    ok = cols < D
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(N):
        if FROM_TILE:
            wj = tl.sum(tl.sum(tl.where((r == 0) & (c == j), w, 0.0), axis=1), axis=0)
        else:
            wj = tl.load(w + t * N + j).to(tl.float32)
        acc += wj * tl.load(x_ptr + (t * N + j) * D + cols, mask=ok, other=0.0).to(tl.float32)
    return acc.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _collapse_kernel(x_ptr, w_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    u = _collapsed(x_ptr, w_ptr, t, D, cols, N, out_ptr.dtype.element_ty, 0, 0, False)
    tl.store(out_ptr + t * D + cols, u.to(out_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def _collapse_rms_norm_row(
    x_ptr, w, g_ptr, out_ptr, t, D, eps, r, c, N: tl.constexpr, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr,
    FROM_TILE: tl.constexpr,
):  # fmt: skip
    """Token t: u = the collapse (``_collapsed`` with ``w``) rounded to the output dtype, then ``_rms_norm_kernel``'s
    arithmetic over u (the same BLOCK / warps). ONE_CHUNK (D <= BLOCK) keeps u in registers; longer rows collapse
    each chunk again for the second pass (the same bits)."""
    cols = tl.arange(0, BLOCK)
    out_dtype = out_ptr.dtype.element_ty
    if ONE_CHUNK:
        u = _collapsed(x_ptr, w, t, D, cols, N, out_dtype, r, c, FROM_TILE)
        inv = inv_rms(tl.sum(u * u, axis=0), D, eps)
        y = u * inv * tl.load(g_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + cols, y.to(out_dtype), mask=cols < D)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, D, BLOCK):
            u = _collapsed(x_ptr, w, t, D, start + cols, N, out_dtype, r, c, FROM_TILE)
            acc += u * u
        inv = inv_rms(tl.sum(acc, axis=0), D, eps)
        for start in range(0, D, BLOCK):
            cc = start + cols
            u = _collapsed(x_ptr, w, t, D, cc, N, out_dtype, r, c, FROM_TILE)
            y = u * inv * tl.load(g_ptr + cc, mask=cc < D, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * D + cc, y.to(out_dtype), mask=cc < D)


@triton.jit
def _collapse_rms_norm_kernel(
    x_ptr, w_ptr, g_ptr, out_ptr, D, eps, N: tl.constexpr, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False
):  # fmt: skip
    """One token: the collapse with its weights [T, n], then the RMSNorm (``_collapse_rms_norm_row``). For bf16
    streams that is bitwise the two kernels in a row (the GPU tests check it at T = 1 to 4096, d = 4096 / 5120);
    fp32 streams agree to fp32 rounding (some rows' statistics differ by an ulp: the sum's register layout follows
    the loads, which differ)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    _collapse_rms_norm_row(x_ptr, w_ptr, g_ptr, out_ptr, t, D, eps, 0, 0, N, BLOCK, ONE_CHUNK, False)


@triton.jit(do_not_specialize=["T"])
def _pre_collapse_rms_norm_kernel(
    ws_ptr, base_ptr, scale_ptr, x_ptr, g_ptr, out_ptr, T, K, D, norm_eps, hc_eps, eps,
    N: tl.constexpr, NP: tl.constexpr, RB: tl.constexpr, NPAD: tl.constexpr, SPLIT: tl.constexpr,
    SP2: tl.constexpr, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One token: pre from its partial mixes (the head epilogue's arithmetic), then the collapse and RMSNorm with
    it in registers (``_collapse_rms_norm_row``), without pre's round trip through memory and a launch."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    z, r, c, off, val = _site_logits(ws_ptr, base_ptr, scale_ptr, t, T, K, norm_eps, N, NP, RB, NPAD, SPLIT, SP2, False)
    pre = _sigmoid(z) + hc_eps
    _collapse_rms_norm_row(x_ptr, pre, g_ptr, out_ptr, t, D, eps, r, c, N, BLOCK, ONE_CHUNK, True)


@triton.jit
def _expand_kernel(
    x_ptr, y_ptr, y_add_ptr, post_ptr, comb_ptr, out_ptr, w_ptr, u_ptr, D, N: tl.constexpr, NP: tl.constexpr,
    HAS_ADD: tl.constexpr, HAS_COLLAPSE: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    k = tl.arange(0, NP)
    k_ok = k < N
    # mixed[k] = sum_j comb[t, j, k] * x[t, j] (the FIRST comb index is contracted), then + post[k] * y
    acc = tl.zeros((NP, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(N):
        c = tl.load(comb_ptr + t * (N * N) + j * N + k, mask=k_ok, other=0.0).to(tl.float32)
        xj = tl.load(x_ptr + (t * N + j) * D + cols, mask=ok, other=0.0).to(tl.float32)
        acc += c[:, None] * xj[None, :]
    post = tl.load(post_ptr + t * N + k, mask=k_ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * D + cols, mask=ok, other=0.0)
    if HAS_ADD:  # y + y_add in y's dtype, as torch adds two tensors of it (fp32 sum, one rounding)
        ya = tl.load(y_add_ptr + t * D + cols, mask=ok, other=0.0)
        y = (y.to(tl.float32) + ya.to(tl.float32)).to(y_ptr.dtype.element_ty)
    acc += post[:, None] * y.to(tl.float32)[None, :]
    o = acc.to(out_ptr.dtype.element_ty)
    dst = out_ptr + (t * N + k[:, None]) * D + cols[None, :]
    tl.store(dst, o, mask=k_ok[:, None] & ok[None, :])
    if HAS_COLLAPSE:
        # the collapse of the streams just stored (``_collapsed``'s arithmetic on their rounded values): each row
        # picked out of the tile by a sum of itself and zeros (exact), weighted and added in stream order
        of = o.to(tl.float32)
        u = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in tl.static_range(N):
            wj = tl.load(w_ptr + t * N + j).to(tl.float32)
            u += wj * tl.sum(tl.where(k[:, None] == j, of, 0.0), axis=0)
        tl.store(u_ptr + t * D + cols, u.to(u_ptr.dtype.element_ty), mask=ok)


def _split(k: int, chunk: int | None = None) -> int:
    """Number of K chunks: from K alone (the batch-invariance argument above depends on this)."""
    return triton.cdiv(k, chunk or CHUNK)


def _mix_config(t: int, adaptive: bool) -> dict:
    """The mixes kernel's chunking and tiling: the invariant one (module constants, read at call time so that
    benchmarks can sweep them), or for ``adaptive`` calls the first ``ADAPTIVE_MIX`` tier that holds T tokens."""
    for max_tokens, cfg in ADAPTIVE_MIX if adaptive else ():
        if t <= max_tokens:
            return cfg
    return {"CHUNK": CHUNK, "BLOCK_T": BLOCK_T, "BLOCK_K": BLOCK_K, "num_warps": MIX_WARPS, "num_stages": MIX_STAGES}


def _mixes_workspace(
    x: torch.Tensor, fn: torch.Tensor, rows: int, adaptive: bool = False
) -> tuple[torch.Tensor, int, int]:
    """(ws [SPLIT, T, NPAD] fp32 partial mixes + sum of squares, SPLIT, NPAD)."""
    t, n, d = x.shape
    k = n * d
    xs = x.reshape(t, k)
    if not xs.is_contiguous():
        xs = xs.contiguous()
    npad = max(16, triton.next_power_of_2(rows + 1))  # + the sum-of-squares column; tl.dot needs N >= 16
    cfg = _mix_config(t, adaptive)
    split = _split(k, cfg["CHUNK"])
    ws = torch.empty(split, t, npad, dtype=torch.float32, device=x.device)
    bf16 = x.dtype == torch.bfloat16
    _mixes_partial_kernel[(split, triton.cdiv(t, cfg["BLOCK_T"]))](
        xs, fn.float().contiguous(), ws, t, k,
        ROWS=rows, NPAD=npad, CHUNK=cfg["CHUNK"], BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"],
        SPLIT_FN=bf16, F32_DOT=not bf16 or interpreting(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_options(xs.device),
    )  # fmt: skip
    return ws, split, npad


def _workspace_meta(n: int, npad: int, split: int) -> dict:
    """The constexprs of ``_site_logits``' view of a token's workspace row (both kernels that read the partials)."""
    return dict(
        N=n, NP=triton.next_power_of_2(n), RB=triton.next_power_of_2(n + 3), NPAD=npad, SPLIT=split,
        SP2=triton.next_power_of_2(split),
    )  # fmt: skip


def mhc_coefficients_triton(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    adaptive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require_same_device(x, fn, base, scale)
    t, n, d = x.shape
    pre = torch.empty(t, n, dtype=torch.float32, device=x.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=x.device)
    if t == 0:
        return pre, post, comb
    ws, split, npad = _mixes_workspace(x, fn, (2 + n) * n, adaptive)
    _coefficients_epilogue_kernel[(t,)](
        ws, base.float().contiguous(), scale.float().contiguous(), pre, post, comb,
        t, n * d, float(norm_eps), float(hc_eps), int(sinkhorn_iters),
        **_workspace_meta(n, npad, split), COMB=True, num_warps=EPI_WARPS, **pdl_options(ws.device),
    )  # fmt: skip
    return pre, post, comb


def mhc_head_weights_triton(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    adaptive: bool = False,
) -> torch.Tensor:
    require_same_device(x, fn, base, scale)
    t, n, d = x.shape
    pre = torch.empty(t, n, dtype=torch.float32, device=x.device)
    if t == 0:
        return pre
    ws, split, npad = _mixes_workspace(x, fn, n, adaptive)
    _coefficients_epilogue_kernel[(t,)](
        ws, base.float().contiguous(), scale.float().contiguous(), pre, pre, pre,
        t, n * d, float(norm_eps), float(hc_eps), 1,
        **_workspace_meta(n, npad, split), COMB=False, num_warps=EPI_WARPS, **pdl_options(ws.device),
    )  # fmt: skip
    return pre


def mhc_collapse_triton(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    require_same_device(x, weights)
    t, n, d = x.shape
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _collapse_kernel[(t, triton.cdiv(d, BLOCK_D))](
        x.contiguous(), weights.contiguous(), out, d, N=n, BLOCK_D=BLOCK_D, num_warps=ELEM_WARPS,
        **pdl_options(x.device),
    )  # fmt: skip
    return out


def mhc_collapse_rms_norm_triton(
    x: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    require_same_device(x, weights, norm_weight)
    t, n, d = x.shape
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block, warps = norm_config(d)  # rms_norm's: the same reduction tree
    _collapse_rms_norm_kernel[(t,)](
        x.contiguous(), weights.contiguous(), norm_weight.contiguous(), out, d, float(eps),
        N=n, BLOCK=block, ONE_CHUNK=d <= block, num_warps=warps, **pdl_options(x.device),
    )  # fmt: skip
    return out


def mhc_pre_collapse_rms_norm_triton(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    eps: float,
    adaptive: bool = False,
) -> torch.Tensor:
    """Two launches: the mixes of fn's n rows (``_mixes_workspace``, as ``mhc_head_weights``), then one program per
    token for pre, the collapse and the norm (``_pre_collapse_rms_norm_kernel``)."""
    require_same_device(x, fn, base, scale, norm_weight)
    t, n, d = x.shape
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    ws, split, npad = _mixes_workspace(x, fn, n, adaptive)
    block, warps = norm_config(d)  # rms_norm's: the same reduction tree
    _pre_collapse_rms_norm_kernel[(t,)](
        ws, base.float().contiguous(), scale.float().contiguous(), x.contiguous(), norm_weight.contiguous(), out,
        t, n * d, d, float(norm_eps), float(hc_eps), float(eps),
        BLOCK=block, ONE_CHUNK=d <= block, **_workspace_meta(n, npad, split), num_warps=warps, **pdl_options(x.device),
    )  # fmt: skip
    return out


def _expand_into(x, y, post, comb, y_add, weights) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The expanded streams and, given collapse ``weights`` [T, n], their collapse [T, d] (one launch)."""
    require_same_device(x, y, post, comb, *(t for t in (y_add, weights) if t is not None))
    t, n, d = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    u = None if weights is None else torch.empty(t, d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out, u
    y = y.contiguous()
    w = weights.contiguous() if weights is not None else post  # dummy pointers when absent (never read)
    _expand_kernel[(t, triton.cdiv(d, BLOCK_D))](
        x.contiguous(), y, y if y_add is None else y_add.contiguous(), post.contiguous(), comb.contiguous(), out,
        w, out if u is None else u, d, N=n, NP=triton.next_power_of_2(n), HAS_ADD=y_add is not None,
        HAS_COLLAPSE=weights is not None, BLOCK_D=BLOCK_D, num_warps=ELEM_WARPS, **pdl_options(x.device),
    )  # fmt: skip
    return out, u


def mhc_expand_triton(
    x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, y_add: torch.Tensor | None = None
) -> torch.Tensor:
    return _expand_into(x, y, post, comb, y_add, None)[0]


def mhc_expand_collapse_triton(
    x: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    weights: torch.Tensor,
    y_add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The expand kernel, which also collapses each program's streams with ``weights`` before it ends: for bf16
    streams bitwise ``mhc_expand`` then ``mhc_collapse``, without the second kernel's read of the streams."""
    return _expand_into(x, y, post, comb, y_add, weights)  # type: ignore[return-value]


def mhc_coefficients_triton_adaptive(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """``mhc_coefficients`` with the tilings for up to ADAPTIVE_MAX_TOKENS tokens (``ADAPTIVE_MIX``): not
    batch-invariant."""
    return mhc_coefficients_triton(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, adaptive=True)


def mhc_head_weights_triton_adaptive(x, fn, base, scale, norm_eps, hc_eps):
    """``mhc_head_weights`` with the tilings for up to ADAPTIVE_MAX_TOKENS tokens (``ADAPTIVE_MIX``): not
    batch-invariant."""
    return mhc_head_weights_triton(x, fn, base, scale, norm_eps, hc_eps, adaptive=True)


def mhc_pre_collapse_rms_norm_triton_adaptive(x, fn, base, scale, norm_weight, norm_eps, hc_eps, eps):
    """``mhc_pre_collapse_rms_norm`` with the tilings for up to ADAPTIVE_MAX_TOKENS tokens: not batch-invariant."""
    return mhc_pre_collapse_rms_norm_triton(x, fn, base, scale, norm_weight, norm_eps, hc_eps, eps, adaptive=True)


for _op, _fn in (
    ("mhc_coefficients", mhc_coefficients_triton),
    ("mhc_head_weights", mhc_head_weights_triton),
    ("mhc_collapse", mhc_collapse_triton),
    ("mhc_collapse_rms_norm", mhc_collapse_rms_norm_triton),
    ("mhc_pre_collapse_rms_norm", mhc_pre_collapse_rms_norm_triton),
    ("mhc_expand", mhc_expand_triton),
    ("mhc_expand_collapse", mhc_expand_collapse_triton),
):
    register_backend(
        _op, "triton", _fn, devices=("cuda",), priority=20, available=triton_cuda_available, batch_invariant=True
    )
for _op, _fn in (
    ("mhc_coefficients", mhc_coefficients_triton_adaptive),
    ("mhc_head_weights", mhc_head_weights_triton_adaptive),
    ("mhc_pre_collapse_rms_norm", mhc_pre_collapse_rms_norm_triton_adaptive),
):
    register_backend(
        _op, "triton_adaptive", _fn, devices=("cuda",), priority=30, available=triton_cuda_available,
        batch_invariant=False,
    )  # fmt: skip
