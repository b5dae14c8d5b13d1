"""Gluon sparse MQA attention for Hopper: all heads of a query in one program, the gathered rows in shared memory.

Serves ``sparse_mqa_attention`` (contract in ``__init__.py``) where every query has whole 64-head blocks and a head
dim of at most 512 in bf16 / fp16 (DeepSeek V4 / V4.1: 64 heads of 512), on sm_90. Program (t, head block): the
query's [64, D] heads go to shared memory once; its index list is walked BLOCK_N entries a step, each step's rows
gathered by ``cp.async`` into a ring of NUM_BUF shared buffers (the next step's gather runs while this one
computes), then S = Q K^T and O += P K on the tensor cores (``warpgroup_mma``, both operands read from shared memory
for S, P from registers for O), with the fp32 online softmax of the Triton kernel between them.

Why not the Triton kernel (``triton.py``) at these sizes: its wide tile (64 heads, 64 entries, one stage) holds the
queries and the [64, 512] fp32 accumulator in registers (255 a thread and a few spills, ptxas for sm_90), so there is
no room for a second stage and each step's gather waits for the previous step's products (every tile / stage / warp
sweep in ``benchmarks/baselines/sparse_mqa_attention_tile_sweep_h200.log`` stays at 15-19% of bf16 at batch 256).
Here the registers hold the accumulator (two warpgroups, 256 value columns each) and one step's scores (ptxas: 240-246
registers, no spills, 196 KB of shared memory at D = 512).

Layout of the work: 8 warps as two warpgroups side by side ([4, 2] warps), each making half of the value columns of
O. The scores either split the same way (each warpgroup half of every step's columns; the softmax's row max / sum
and P cross the halves through shared memory) or, with DUP_S, are made whole by both warpgroups (twice the Q K^T
work, every exchange in registers). On an H200 (``bench_sparse_mqa_attention.py --wide``) the split scores with
two buffers of 64 entries win everywhere: 92 us at 256 queries x 640 entries against 98 with DUP_S and 120-124 for
the 32-entry rings (Triton's wide tile: 131 us), so the launcher defaults to them.

Numerics as the Triton kernel: fp32 scores and softmax, P rounded to the KV dtype for the P V product, the sink
added at the end; results agree with the fp32 reference to ~1e-3 relative (bf16), not bitwise with the Triton
kernel. Not batch-invariant by registration (it serves the wide calls of the adaptive path only), though a row's
arithmetic depends on its own list alone.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer_kernels.ops._triton_launch import hopper, pdl_options, triton_cuda_available
from deepinfer_kernels.ops.rope import rope_interleaved
from deepinfer_kernels.registry import register_backend

from .triton import prepare_call, sparse_mqa_attention_triton_adaptive

HEADS = 64  # heads per program: one wgmma M block per warpgroup row
WARPS = 8
MAX_D = 512  # shared memory: the queries [64, D] + NUM_BUF gathered tiles [BLOCK_N, D] in bf16
SMEM_BYTES = 200 * 1024  # what the buffers may take of the H200's 227 KB (the reductions' scratch needs the rest)


@gluon.jit
def _gather_tile(
    buf, kv_ptr, kv2_ptr, idx_row, j0, K, N1, kv_s, kv2_s, rows, cols, TWO: gl.constexpr
):  # fmt: skip
    """Issue the cp.async gather of entries [j0, j0 + BLOCK_N) of the row's list into ``buf`` ([BLOCK_N, D]) as one
    commit group; slots past K or -1 are masked (zero-filled, and their scores are masked to -inf later)."""
    n = j0 + rows
    slot = gl.load(idx_row + n, mask=n < K, other=-1).to(gl.int64)
    ok = slot >= 0
    if TWO:  # rows past the first segment's N1 are rows of the second
        base = gl.where(slot < N1, kv_ptr + slot * kv_s, kv2_ptr + (slot - N1) * kv2_s)
    else:
        base = kv_ptr + slot * kv_s
    cp.async_copy_global_to_shared(buf, base[:, None] + cols[None, :], mask=ok[:, None])
    cp.commit_group()


@gluon.jit
def _attn_wide_kernel(
    q_ptr, kv_ptr, kv2_ptr, idx_ptr, sink_ptr, o_ptr,
    K, N1, scale, q_st, q_sh, kv_s, kv2_s, idx_st, o_st, o_sh,
    D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, DUP_S: gl.constexpr, COPY_L: gl.constexpr,
    Q_SL: gl.constexpr, K_SL: gl.constexpr, TWO: gl.constexpr, num_warps: gl.constexpr,
    PDL: gl.constexpr = False,
):  # fmt: skip
    H: gl.constexpr = 64
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * H
    dtype: gl.constexpr = kv_ptr.dtype.element_ty

    # registers: 16-byte vectors along D for the copies (COPY_L); the two wgmma layouts (two warpgroups side by side)
    cl: gl.constexpr = COPY_L
    # DUP_S: both warpgroups make the whole S (twice the Q K^T work, no softmax / P exchange through shared memory)
    S_N: gl.constexpr = BLOCK_N if DUP_S else BLOCK_N // 2
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, S_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)

    cols = gl.arange(0, D, layout=gl.SliceLayout(0, cl))
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cl))
    idx_row = idx_ptr + t * idx_st
    k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, D], K_SL)
    for i in gl.static_range(NUM_BUF - 1):  # the ring's first tiles in flight before the queries are staged
        _gather_tile(k_smem.index(i), kv_ptr, kv2_ptr, idx_row, i * BLOCK_N, K, N1, kv_s, kv2_s, rows, cols, TWO)

    heads = gl.arange(0, H, layout=gl.SliceLayout(1, cl))
    q = gl.load(q_ptr + t * q_st + (h0 + heads)[:, None] * q_sh + cols[None, :])
    q_smem = gl.allocate_shared_memory(dtype, [H, D], Q_SL, q.to(dtype))

    m_i = gl.full([H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_l))  # finite: exp(m_old - m_new) stays NaN-free
    l_i = gl.zeros([H], gl.float32, layout=gl.SliceLayout(1, s_l))
    acc = gl.zeros([H, D], gl.float32, layout=o_l)
    s_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    for i in range(gl.cdiv(K, BLOCK_N)):
        # the buffer refilled next was read by the previous step's products: every warpgroup must be past them
        gl.thread_barrier()
        nxt = i + NUM_BUF - 1
        _gather_tile(
            k_smem.index(nxt % NUM_BUF), kv_ptr, kv2_ptr, idx_row, nxt * BLOCK_N, K, N1, kv_s, kv2_s, rows, cols, TWO
        )  # fmt: skip
        cp.wait_group(NUM_BUF - 1)  # this thread's copies of step i have landed
        fence_async_shared()  # ... and are visible to the tensor cores' (async proxy) reads
        gl.thread_barrier()  # ... for every thread's copies
        kb = k_smem.index(i % NUM_BUF)
        s = warpgroup_mma(
            q_smem, kb.permute((1, 0)), gl.zeros([H, BLOCK_N], gl.float32, s_l), use_acc=False, is_async=True
        )
        n = i * BLOCK_N + s_cols
        live = gl.load(idx_row + n, mask=n < K, other=-1) >= 0  # read while the tensor cores make S
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where(live[None, :], s * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp(m_i - m_new)
        p = gl.exp(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_l), kb, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    cp.wait_group(0)  # the ring's trailing (masked) gathers

    o_rows = gl.arange(0, H, layout=gl.SliceLayout(1, o_l))
    o_cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
    sink = gl.load(sink_ptr + h0 + o_rows)
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_l))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
    top = gl.maximum(m_o, sink)
    a = gl.exp(m_o - top)
    o = acc * (a / (l_o * a + gl.exp(sink - top)))[:, None]
    gl.store(o_ptr + t * o_st + (h0 + o_rows)[:, None] * o_sh + o_cols[None, :], o.to(o_ptr.dtype.element_ty))


def copy_layout(d: int) -> gl.BlockedLayout:
    """Rows of D elements as 16-byte vectors: a warp spans min(32, D / 8) vectors of a row, the rest of its lanes
    the next rows (no lane copies an element twice)."""
    lanes = min(32, d // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [WARPS, 1], [1, 0])


def wide_meta(d: int, dtype: torch.dtype, block_n: int = 64, num_buf: int | None = None, dup_s: bool = False) -> dict:
    """The kernel's tiling constexprs for head dim ``d`` in ``dtype`` (bf16 / fp16): BLOCK_N entries a step, as many
    gather buffers (NUM_BUF, 2-4) as SMEM_BYTES holds beside the queries unless ``num_buf`` is given, and DUP_S."""
    el = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    tile, queries = block_n * d * 2, HEADS * d * 2
    buffers = num_buf or max(2, min(4, (SMEM_BYTES - queries) // tile))
    return dict(
        D=d, BLOCK_N=block_n, NUM_BUF=buffers, DUP_S=dup_s, COPY_L=copy_layout(d),
        Q_SL=gl.NVMMASharedLayout.get_default_for([HEADS, d], el),
        K_SL=gl.NVMMASharedLayout.get_default_for([block_n, d], el),
    )  # fmt: skip


def serves(q: torch.Tensor, segments: list[torch.Tensor]) -> bool:
    """Whole 64-head blocks, a power-of-two head dim of 64-512, bf16 / fp16 queries and rows, rows that start on
    16 bytes (the gather copies 16-byte vectors), Hopper or later."""
    t, h, d = q.shape
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and h % HEADS == 0
        and 64 <= d <= MAX_D
        and d & (d - 1) == 0
        and all(
            s.dtype == q.dtype and s.stride(-1) == 1 and s.stride(0) % 8 == 0 and s.data_ptr() % 16 == 0
            for s in segments
        )  # fmt: skip
        and hopper(q.device)  # wgmma: sm_90 only
    )


def launch_wide(
    q: torch.Tensor, kv, indices: torch.Tensor, sinks: torch.Tensor, scale: float, *, block_n: int = 64,
    num_buf: int | None = None, dup_s: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Run the kernel (callers check ``serves``). The tiling (``wide_meta``) is exposed for the benchmark's sweep."""
    q, segments, indices, sinks, out, done = prepare_call(q, kv, indices, sinks)
    if done:
        return out
    t, h, d = q.shape
    k = indices.shape[1]
    kv1, kv2 = segments[0], segments[-1]
    _attn_wide_kernel[(t, h // HEADS)](
        q, kv1, kv2, indices, sinks, out, k, kv1.shape[0], float(scale),
        q.stride(0), q.stride(1), kv1.stride(0), kv2.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        **wide_meta(d, q.dtype, block_n, num_buf, dup_s), TWO=len(segments) == 2, num_warps=WARPS,
        **pdl_options(q.device),
    )  # fmt: skip
    return out


WIDE_MIN_ROWS = 64  # queries from which the wide kernel takes a call (fewer leave most SMs idle at 64 heads a program)


def sparse_mqa_attention_gluon_adaptive(q, kv, indices, sinks, scale, out_rope=None):
    """``triton_adaptive``, with the calls of at least WIDE_MIN_ROWS queries that ``serves`` accepts on the wide
    kernel. The default on Hopper (above ``triton_adaptive``): at 256 decode queries x 640 entries 92 against 131 us,
    at 64 x 640 (32K) 42 against 50 us, at an 8K prefill 2.55 against 3.27 ms (H200, ``--wide``). Not
    batch-invariant (the Triton tiles below). ``out_rope``: fused in the Triton kernels, after the wide one."""
    segments = list(kv) if isinstance(kv, (tuple, list)) else [kv]
    if q.shape[0] >= WIDE_MIN_ROWS and serves(q, segments):
        out = launch_wide(q, kv, indices, sinks, scale)
        if out_rope is not None:
            out = rope_interleaved(out, *out_rope, inverse=True, out=out)
        return out
    return sparse_mqa_attention_triton_adaptive(q, kv, indices, sinks, scale, out_rope)


sparse_mqa_attention_gluon_adaptive.fuses_out_rope = True  # takes out_rope (see sparse_mqa_attention's front end)


def _hopper() -> bool:
    return triton_cuda_available() and hopper()


register_backend(
    "sparse_mqa_attention", "gluon_adaptive", sparse_mqa_attention_gluon_adaptive, devices=("cuda",), priority=40,
    available=_hopper, batch_invariant=False,
)  # fmt: skip
