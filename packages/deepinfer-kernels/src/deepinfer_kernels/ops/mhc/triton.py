"""Triton mHC (CUDA backend ``triton``): coefficients, hc_head weights, collapse and expand.

``mhc_coefficients`` / ``mhc_head_weights`` are two launches whatever T is:

1. ``_mixes_partial_kernel``: the flattened K = n*d input of a token is cut into SPLIT fixed chunks of
   CHUNK columns; program (s, tile) takes chunk s of BLOCK_T tokens and writes, per token, the partial
   mixes ``x[chunk] @ fn[:, chunk]^T`` (fp32 accumulation) and the partial sum of squares into an fp32
   workspace [SPLIT, T, NPAD] (the sum of squares sits in column ROWS). The norm factors out of the matmul
   (m = (flat @ fn^T) * rsqrt(mean(flat^2) + eps)), so nothing waits for the statistic. fn stays fp32: bf16
   x meets it as three bf16 parts (hi + mid + lo carry fn's 24-bit significand; bf16 x bf16 products are
   exact in fp32), other dtypes as IEEE fp32 products (no TF32), so the mixes agree with the fp32 reference
   to fp32 rounding.
2. ``_coefficients_epilogue_kernel``: per token, adds the SPLIT partials in split order, applies the rsqrt
   and the whole epilogue in registers: sigmoid pre / post (or the head's sigmoid), then softmax + hc_eps and
   Sinkhorn (one column pass, then iters - 1 row and column passes, hc_eps in every divide) on the n x n
   comb, exactly as ``reference.py`` orders it.

SPLIT, CHUNK, BLOCK_T, BLOCK_K and the warp counts depend on K alone, T is not specialised, and the split
partials are added in a fixed order, so a token's bits never depend on T or on the other tokens:
batch-invariant by construction (the GPU tests check one token alone against the same token inside 7, 64
and 4096). The order differs from the reference's (16-row tiled GEMM after the norm), so results match it
to fp32 rounding (~1e-6 relative), not bitwise.

``mhc_collapse`` / ``mhc_expand``: one program per (token, BLOCK_D columns), fp32 arithmetic, one cast at the
store; purely elementwise per token, hence batch-invariant too.

Importing this module registers the backends; it needs triton (the op's ``__init__`` guards the import).
CPU tensors run in Triton's interpreter when TRITON_INTERPRET=1 (tests only; registered for "cuda").
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._triton_launch import interpreting, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

# Mixes: K columns per split (fixes each token's reduction order), tokens and columns per program step.
CHUNK = 1024
BLOCK_T = 64
BLOCK_K = 128
MIX_WARPS = 4
MIX_STAGES = 3
EPI_BLOCK_T = 16  # tokens per epilogue program
BLOCK_D = 1024  # columns per collapse / expand program
ELEM_WARPS = 4


@triton.jit(do_not_specialize=["T"])
def _mixes_partial_kernel(
    x_ptr, fn_ptr, ws_ptr, T, K,
    ROWS: tl.constexpr, NPAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_FN: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(0)
    tok = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = tok < T
    r = tl.arange(0, NPAD)
    r_ok = r < ROWS
    kb = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, NPAD), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    k_lo = pid_s * CHUNK
    for k0 in range(k_lo, tl.minimum(k_lo + CHUNK, K), BLOCK_K):
        kk = k0 + kb
        k_ok = kk < K
        xv = tl.load(x_ptr + tok[:, None] * K + kk[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(fn_ptr + r[:, None] * K + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        xf = xv.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        if SPLIT_FN:  # bf16 x: fn = hi + mid + lo exactly enough for fp32 (each step is exact in fp32)
            hi = w.to(tl.bfloat16)
            rem = w - hi.to(tl.float32)
            mid = rem.to(tl.bfloat16)
            lo = (rem - mid.to(tl.float32)).to(tl.bfloat16)
            if F32_DOT:  # the CPU interpreter, whose bf16 dot is wrong: the same exact products in fp32
                acc = tl.dot(xf, tl.trans(lo.to(tl.float32)), acc, input_precision="ieee")
                acc = tl.dot(xf, tl.trans(mid.to(tl.float32)), acc, input_precision="ieee")
                acc = tl.dot(xf, tl.trans(hi.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xv, tl.trans(lo), acc)
                acc = tl.dot(xv, tl.trans(mid), acc)
                acc = tl.dot(xv, tl.trans(hi), acc)
        else:
            acc = tl.dot(xf, tl.trans(w), acc, input_precision="ieee")
    acc = tl.where(r[None, :] == ROWS, sq[:, None], acc)  # column ROWS carries the sum of squares
    dst = ws_ptr + (pid_s.to(tl.int64) * T + tok[:, None]) * NPAD + r[None, :]
    tl.store(dst, acc, mask=t_ok[:, None])


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit(do_not_specialize=["T"])
def _coefficients_epilogue_kernel(
    ws_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
    T, K, norm_eps, hc_eps, iters,
    N: tl.constexpr, NP: tl.constexpr, NPAD: tl.constexpr, SPLIT: tl.constexpr, COMB: tl.constexpr,
    BLOCK_T: tl.constexpr,
):  # fmt: skip
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = tok < T
    i = tl.arange(0, NP)
    i_ok = i < N
    ti_ok = t_ok[:, None] & i_ok[None, :]
    jk_ok = i_ok[:, None] & i_ok[None, :]  # [j, k] inside the n x n comb
    jk = i[:, None] * N + i[None, :]
    tjk_ok = t_ok[:, None, None] & jk_ok[None, :, :]

    # the split partials of each token, added in split order (fixed: batch-invariant)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    m_pre = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    m_post = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    m_comb = tl.zeros((BLOCK_T, NP, NP), dtype=tl.float32)
    for s in range(SPLIT):
        row = ws_ptr + (s * T + tok) * NPAD
        if COMB:
            sq += tl.load(row + (2 + N) * N, mask=t_ok, other=0.0)
            m_post += tl.load(row[:, None] + N + i[None, :], mask=ti_ok, other=0.0)
            m_comb += tl.load(row[:, None, None] + 2 * N + jk[None, :, :], mask=tjk_ok, other=0.0)
        else:
            sq += tl.load(row + N, mask=t_ok, other=0.0)
        m_pre += tl.load(row[:, None] + i[None, :], mask=ti_ok, other=0.0)
    inv = 1.0 / tl.sqrt_rn(sq / K + norm_eps)  # RMSNorm of the flattened streams, applied to the mixes

    if COMB:
        s_pre = tl.load(scale_ptr)
        s_post = tl.load(scale_ptr + 1)
        s_comb = tl.load(scale_ptr + 2)
        b_pre = tl.load(base_ptr + i, mask=i_ok, other=0.0)
        b_post = tl.load(base_ptr + N + i, mask=i_ok, other=0.0)
        b_comb = tl.load(base_ptr + 2 * N + jk, mask=jk_ok, other=0.0)
        pre = _sigmoid((m_pre * inv[:, None]) * s_pre + b_pre[None, :]) + hc_eps
        post = 2.0 * _sigmoid((m_post * inv[:, None]) * s_post + b_post[None, :])
        # comb logits L[t, j, k]; softmax over k (row j = input stream j), padding outside the n x n block
        logits = (m_comb * inv[:, None, None]) * s_comb + b_comb[None, :, :]
        logits = tl.where(jk_ok[None, :, :], logits, -1e30)
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
        comb = tl.where(jk_ok[None, :, :], comb, 0.0)
        # Sinkhorn-Knopp: one column pass, then (iters - 1) row + column passes, eps in every divide
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        tl.store(post_ptr + tok[:, None] * N + i[None, :], post, mask=ti_ok)
        tl.store(comb_ptr + tok[:, None, None] * (N * N) + jk[None, :, :], comb, mask=tjk_ok)
    else:  # hc_head: sigmoid(m * scale + base) + hc_eps only
        b_pre = tl.load(base_ptr + i, mask=i_ok, other=0.0)
        pre = _sigmoid((m_pre * inv[:, None]) * tl.load(scale_ptr) + b_pre[None, :]) + hc_eps
    tl.store(pre_ptr + tok[:, None] * N + i[None, :], pre, mask=ti_ok)


@triton.jit
def _collapse_kernel(x_ptr, w_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(N):
        w = tl.load(w_ptr + t * N + j).to(tl.float32)
        acc += w * tl.load(x_ptr + (t * N + j) * D + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _expand_kernel(
    x_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, D, N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
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
    y = tl.load(y_ptr + t * D + cols, mask=ok, other=0.0).to(tl.float32)
    acc += post[:, None] * y[None, :]
    dst = out_ptr + (t * N + k[:, None]) * D + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & ok[None, :])


def _split(k: int) -> int:
    """Number of K chunks: from K alone (the batch-invariance argument above depends on this)."""
    return triton.cdiv(k, CHUNK)


def _mixes_workspace(x: torch.Tensor, fn: torch.Tensor, rows: int) -> tuple[torch.Tensor, int, int]:
    """(ws [SPLIT, T, NPAD] fp32 partial mixes + sum of squares, SPLIT, NPAD)."""
    t, n, d = x.shape
    k = n * d
    xs = x.reshape(t, k)
    if not xs.is_contiguous():
        xs = xs.contiguous()
    npad = max(16, triton.next_power_of_2(rows + 1))  # + the sum-of-squares column; tl.dot needs N >= 16
    split = _split(k)
    ws = torch.empty(split, t, npad, dtype=torch.float32, device=x.device)
    bf16 = x.dtype == torch.bfloat16
    _mixes_partial_kernel[(split, triton.cdiv(t, BLOCK_T))](
        xs, fn.float().contiguous(), ws, t, k,
        ROWS=rows, NPAD=npad, CHUNK=CHUNK, BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K,
        SPLIT_FN=bf16, F32_DOT=not bf16 or interpreting(), num_warps=MIX_WARPS, num_stages=MIX_STAGES,
    )  # fmt: skip
    return ws, split, npad


def mhc_coefficients_triton(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require_same_device(x, fn, base, scale)
    t, n, d = x.shape
    pre = torch.empty(t, n, dtype=torch.float32, device=x.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=x.device)
    if t == 0:
        return pre, post, comb
    ws, split, npad = _mixes_workspace(x, fn, (2 + n) * n)
    _coefficients_epilogue_kernel[(triton.cdiv(t, EPI_BLOCK_T),)](
        ws, base.float().contiguous(), scale.float().contiguous(), pre, post, comb,
        t, n * d, float(norm_eps), float(hc_eps), int(sinkhorn_iters),
        N=n, NP=triton.next_power_of_2(n), NPAD=npad, SPLIT=split, COMB=True, BLOCK_T=EPI_BLOCK_T, num_warps=1,
    )  # fmt: skip
    return pre, post, comb


def mhc_head_weights_triton(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    require_same_device(x, fn, base, scale)
    t, n, d = x.shape
    pre = torch.empty(t, n, dtype=torch.float32, device=x.device)
    if t == 0:
        return pre
    ws, split, npad = _mixes_workspace(x, fn, n)
    _coefficients_epilogue_kernel[(triton.cdiv(t, EPI_BLOCK_T),)](
        ws, base.float().contiguous(), scale.float().contiguous(), pre, pre, pre,
        t, n * d, float(norm_eps), float(hc_eps), 1,
        N=n, NP=triton.next_power_of_2(n), NPAD=npad, SPLIT=split, COMB=False, BLOCK_T=EPI_BLOCK_T, num_warps=1,
    )  # fmt: skip
    return pre


def mhc_collapse_triton(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    require_same_device(x, weights)
    t, n, d = x.shape
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _collapse_kernel[(t, triton.cdiv(d, BLOCK_D))](
        x.contiguous(), weights.contiguous(), out, d, N=n, BLOCK_D=BLOCK_D, num_warps=ELEM_WARPS
    )
    return out


def mhc_expand_triton(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    require_same_device(x, y, post, comb)
    t, n, d = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    _expand_kernel[(t, triton.cdiv(d, BLOCK_D))](
        x.contiguous(), y.contiguous(), post.contiguous(), comb.contiguous(), out, d,
        N=n, NP=triton.next_power_of_2(n), BLOCK_D=BLOCK_D, num_warps=ELEM_WARPS,
    )  # fmt: skip
    return out


for _op, _fn in (
    ("mhc_coefficients", mhc_coefficients_triton),
    ("mhc_head_weights", mhc_head_weights_triton),
    ("mhc_collapse", mhc_collapse_triton),
    ("mhc_expand", mhc_expand_triton),
):
    register_backend(
        _op, "triton", _fn, devices=("cuda",), priority=20, available=triton_cuda_available, batch_invariant=True
    )
