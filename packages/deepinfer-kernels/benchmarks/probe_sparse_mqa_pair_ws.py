"""Probe (not a backend): warp-specialised Gluon sparse MQA attention for Hopper, two math warpgroups on alternate
64-entry blocks and a producer warpgroup that gathers them. Correct; slower than the wide kernel it was to replace.

What it is (program = one query's 64-head block, 12 warps; the layout of DeepSeek's FlashMLA sparse prefill kernel
for sm_90, written anew in Gluon):

- the producer warpgroup stages the query's [64, 512] heads once, then gathers the index list's rows 64 entries a
  block by ``cp.async`` into two buffers, each in two column halves ([64, 256]) with their own ready / free
  mbarriers (the copies arrive on the ready barrier as they land: ``cp.async.mbarrier.arrive.noinc``);
- math warpgroup w takes blocks 2r + w (buffer w) of every pair r: S = Q K^T for its whole block (wgmma m64n64, half
  the shared-memory reads per FLOP of the wide kernel's m64n32 split), the pair's running max exchanged through
  shared memory (warpgroup 0 publishes max(m, its rows' max), warpgroup 1 the max of that and its own, both use the
  latter), then O[:, its half of the 512 value columns] += P V for its own block (P from registers) and for the other
  warpgroup's (that P through shared memory). Both end every pair with the same max, so the row sums add at the end.

Measured (H200, session 40, CUDA graphs; ``python packages/deepinfer-kernels/benchmarks/probe_sparse_mqa_pair_ws.py``):
relative error 2e-3 against the fp32 reference at every shape (K = 1 .. 640, rows of -1, an all -1 row: zeros, two
segments bitwise one pool); but 0.60-0.73x the wide kernel (``gluon.py``): decode 64 / 256 queries x 640 entries
69 / 150 us against 42 / 95, prefill 8K x 640 3521 against 2553 us, 8K x 2176 10588 against 7496 us (33% of bf16).

Why, and what would be next: both math warpgroups spill at 216-232 registers (ptxas: ~0.9 KB of spills; the
[64, 256] fp32 accumulator alone is 128), and the pair's max exchange puts them in lockstep, so the tensor cores idle
through both softmaxes. FlashMLA avoids both: warpgroup 0 issues its own-block P V before the exchange (rescaling
its P and O afterwards) and each warpgroup issues its next block's S while the remote P V runs; its math warpgroups
fit in 216 registers. Those two overlaps, and the spills gone, are what this needs before it can beat the wide one.
"""

import torch
from deepinfer_kernels.ops._triton_launch import pdl_options
from deepinfer_kernels.ops.sparse_mqa_attention.gluon import _gather_tile
from deepinfer_kernels.ops.sparse_mqa_attention.triton import prepare_call
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

HEADS = gl.constexpr(64)  # heads per program: the wgmma M of each math warpgroup
D = gl.constexpr(512)  # the head dim served: two column halves of 256, one per math warpgroup
HALF = gl.constexpr(256)
BLOCK_N = gl.constexpr(64)  # entries per block; a pair of blocks per round
CHUNK = gl.constexpr(16)  # rows of one producer copy call
# setmaxnreg of the worker math warpgroup and the producer (the default math warpgroup gets what is left of 512)
MATH_REGS = gl.constexpr(224)
PRODUCER_REGS = gl.constexpr(64)

# barrier slots
_Q, _READY, _FREE, _M, _P, _L = (gl.constexpr(i) for i in (0, 1, 5, 9, 11, 13))
_NUM_BARS = gl.constexpr(15)


@gluon.jit
def _gather_half(buf, base_ptr, kv2_ptr, idx_row, j0, K, N1, kv_s, kv2_s, col0, TWO: gl.constexpr):
    """cp.async of entries [j0, j0 + BLOCK_N), columns [col0, col0 + HALF) into ``buf`` ([BLOCK_N, HALF]) by the 4
    producer warps, 16 rows a call (4 row addresses a lane: the producer runs on few registers), each by the wide
    kernel's ``_gather_tile`` (slots past K or -1 zero-filled)."""
    cl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, cl))
    cols = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, cl))
    for c in gl.static_range(BLOCK_N // CHUNK):
        _gather_tile(
            buf.slice(c * CHUNK, CHUNK, dim=0), base_ptr, kv2_ptr, idx_row, j0 + c * CHUNK, K, N1, kv_s, kv2_s, rows,
            cols, TWO,
        )  # fmt: skip


@gluon.jit
def _producer(
    q_ptr, kv_ptr, kv2_ptr, idx_row, q_row, q_sh, K, N1, kv_s, kv2_s, q_smem, k_smem, bars, TWO: gl.constexpr
):  # fmt: skip
    # the queries: [64, HALF] per half, 16-byte copies
    cl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    heads = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, cl))
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, cl))
    for qh in gl.static_range(2):
        for c in gl.static_range(HEADS // CHUNK):
            cp.async_copy_global_to_shared(
                q_smem.index(qh).slice(c * CHUNK, CHUNK, dim=0),
                q_row + (c * CHUNK + heads)[:, None] * q_sh + (qh * HALF + cols)[None, :],
            )
    cp.mbarrier_arrive(bars.index(_Q), increment_count=False)
    for r in range(gl.cdiv(K, 2 * BLOCK_N)):
        free_phase = (r & 1) ^ 1  # a fresh barrier passes the wait for parity 1: the first round finds all free
        # each warpgroup's S reads its buffer's own half first (the half only it uses), then the shared one
        for bh in gl.static_range(4):  # (buffer, half): (0, 0), (1, 1), (0, 1), (1, 0)
            slot = 2 * (bh % 2) + (bh + bh // 2) % 2
            mbarrier.wait(bars.index(_FREE + slot), free_phase)
            _gather_half(
                k_smem.index(slot), kv_ptr, kv2_ptr, idx_row, (2 * r + bh % 2) * BLOCK_N, K, N1, kv_s, kv2_s,
                ((bh + bh // 2) % 2) * HALF, TWO,
            )  # fmt: skip
            cp.mbarrier_arrive(bars.index(_READY + slot), increment_count=False)


@gluon.jit
def _math(
    idx_row, sink_row, o_row, o_sh, K, scale, q_smem, k_smem, p_smem, x_smem, bars, W: gl.constexpr
):  # fmt: skip
    """Math warpgroup W: blocks 2r + W of every pair r, value columns [W * HALF, (W + 1) * HALF)."""
    dtype: gl.constexpr = k_smem.dtype
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    OWN: gl.constexpr = 2 * W + W  # buffer W, half W: read by this warpgroup alone (its S and its own P V)
    MINE: gl.constexpr = 2 * W + (1 - W)  # buffer W, the other half: this S, the other warpgroup's P V
    THEIRS: gl.constexpr = 2 * (1 - W) + W  # the other buffer, this half: the other S, this warpgroup's P V

    m_run = gl.full([HEADS], -1.0e30, gl.float32, layout=row_s)  # finite: exp(m_old - m_new) stays NaN-free
    l_run = gl.zeros([HEADS], gl.float32, layout=row_s)
    acc = gl.zeros([HEADS, HALF], gl.float32, layout=o_l)
    s_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    mbarrier.wait(bars.index(_Q), 0)
    for r in range(gl.cdiv(K, 2 * BLOCK_N)):
        ph = r & 1
        mbarrier.wait(bars.index(_READY + OWN), ph)
        fence_async_shared()  # the landed cp.async rows, to the tensor cores' (async proxy) reads
        s = warpgroup_mma(
            q_smem.index(W), k_smem.index(OWN).permute((1, 0)), gl.zeros([HEADS, BLOCK_N], gl.float32, s_l),
            use_acc=False, is_async=True,
        )  # fmt: skip
        mbarrier.wait(bars.index(_READY + MINE), ph)
        fence_async_shared()
        s = warpgroup_mma(q_smem.index(1 - W), k_smem.index(MINE).permute((1, 0)), s, is_async=True)
        n = (2 * r + W) * BLOCK_N + s_cols
        live = gl.load(idx_row + n, mask=n < K, other=-1) >= 0  # read while the tensor cores make S
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(bars.index(_FREE + MINE))  # its other reader is the other warpgroup's P V
        s = gl.where(live[None, :], s * scale, float("-inf"))
        # the pair's max: warpgroup 0 publishes max(m, its rows' max), warpgroup 1 the max of that and its own
        if W == 0:
            x_smem.index(0).store(gl.maximum(m_run, gl.max(s, axis=1)))
            mbarrier.arrive(bars.index(_M))
            mbarrier.wait(bars.index(_M + 1), ph)
            m_new = x_smem.index(1).load(row_s)
        else:
            mbarrier.wait(bars.index(_M), ph)
            m_new = gl.maximum(x_smem.index(0).load(row_s), gl.max(s, axis=1))
            x_smem.index(1).store(m_new)
            mbarrier.arrive(bars.index(_M + 1))
        alpha = gl.exp(m_run - m_new)
        m_run = m_new
        p = gl.exp(s - m_new[:, None])
        l_run = l_run * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p = p.to(dtype)
        p_own = gl.convert_layout(p, p_l)
        acc = warpgroup_mma(p_own, k_smem.index(OWN), acc, is_async=True)
        p_smem.index(W).store(p)  # the same rounded P for the other warpgroup's half of the columns
        fence_async_shared()
        mbarrier.arrive(bars.index(_P + W))
        mbarrier.wait(bars.index(_P + 1 - W), ph)
        acc = warpgroup_mma(p_smem.index(1 - W), k_smem.index(THEIRS), acc, is_async=True)
        acc, p_own = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_own))
        mbarrier.arrive(bars.index(_FREE + OWN))
        mbarrier.arrive(bars.index(_FREE + THEIRS))

    # the row sums of both warpgroups are relative to the same final max: add them
    gl.thread_barrier()  # every lane of this warpgroup is past its last read of x_smem
    x_smem.index(2 + W).store(l_run)
    mbarrier.arrive(bars.index(_L + W))
    mbarrier.wait(bars.index(_L + 1 - W), 0)
    l_tot = gl.convert_layout(l_run + x_smem.index(3 - W).load(row_s), row_o)
    o_rows = gl.arange(0, HEADS, layout=row_o)
    o_cols = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
    sink = gl.load(sink_row + o_rows)
    m_o = gl.convert_layout(m_run, row_o)
    top = gl.maximum(m_o, sink)
    a = gl.exp(m_o - top)
    o = acc * (a / (l_tot * a + gl.exp(sink - top)))[:, None]
    gl.store(o_row + o_rows[:, None] * o_sh + o_cols[None, :], o.to(o_row.dtype.element_ty))


@gluon.jit
def _attn_pair_kernel(
    q_ptr, kv_ptr, kv2_ptr, idx_ptr, sink_ptr, o_ptr,
    K, N1, scale, q_st, q_sh, kv_s, kv2_s, idx_st, o_st, o_sh,
    Q_SL: gl.constexpr, K_SL: gl.constexpr, P_SL: gl.constexpr, TWO: gl.constexpr, num_warps: gl.constexpr,
    PDL: gl.constexpr = False,
):  # fmt: skip
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * HEADS
    dtype: gl.constexpr = kv_ptr.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [2, HEADS, HALF], Q_SL)
    k_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_N, HALF], K_SL)  # [buffer * 2 + half]
    p_smem = gl.allocate_shared_memory(dtype, [2, HEADS, BLOCK_N], P_SL)
    x_smem = gl.allocate_shared_memory(
        gl.float32, [4, HEADS], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    )  # the pair's maxes of warpgroups 0 / 1, then their row sums
    bars = gl.allocate_shared_memory(gl.int64, [_NUM_BARS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(_Q), count=128)  # one cp.async arrival per producer lane
    for i in gl.static_range(4):
        mbarrier.init(bars.index(_READY + i), count=128)
    # free: buffer-half 0 / 3 have one reader warpgroup, 1 / 2 two (one's S, the other's P V)
    for i in gl.static_range(4):
        mbarrier.init(bars.index(_FREE + i), count=2 if i == 1 or i == 2 else 1)
    for i in gl.static_range(_M, _NUM_BARS):
        mbarrier.init(bars.index(i), count=1)

    idx_row = idx_ptr + t * idx_st
    sink_row = sink_ptr + h0
    o_row = o_ptr + t * o_st + h0 * o_sh
    q_row = q_ptr + t * q_st + h0 * q_sh
    gl.warp_specialize(
        [
            (_math, (idx_row, sink_row, o_row, o_sh, K, scale, q_smem, k_smem, p_smem, x_smem, bars, 0)),
            (_math, (idx_row, sink_row, o_row, o_sh, K, scale, q_smem, k_smem, p_smem, x_smem, bars, 1)),
            (_producer, (q_ptr, kv_ptr, kv2_ptr, idx_row, q_row, q_sh, K, N1, kv_s, kv2_s, q_smem, k_smem, bars, TWO)),
        ],
        [4, 4],
        [MATH_REGS, PRODUCER_REGS],
    )


def pair_meta(dtype: torch.dtype) -> dict:
    el = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return dict(
        Q_SL=gl.NVMMASharedLayout.get_default_for([HEADS.value, HALF.value], el),
        K_SL=gl.NVMMASharedLayout.get_default_for([BLOCK_N.value, HALF.value], el),
        P_SL=gl.NVMMASharedLayout.get_default_for([HEADS.value, BLOCK_N.value], el),
    )


def launch_pair(q: torch.Tensor, kv, indices: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Run the kernel on what the wide kernel's ``serves`` accepts with a head dim of 512."""
    q, segments, indices, sinks, out, done = prepare_call(q, kv, indices, sinks)
    if done:
        return out
    t, h, _ = q.shape
    kv1, kv2 = segments[0], segments[-1]
    _attn_pair_kernel[(t, h // HEADS.value)](
        q, kv1, kv2, indices, sinks, out, indices.shape[1], kv1.shape[0], float(scale),
        q.stride(0), q.stride(1), kv1.stride(0), kv2.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        **pair_meta(q.dtype), TWO=len(segments) == 2, num_warps=4, **pdl_options(q.device),
    )  # fmt: skip
    return out


def main() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _bench_util import graph_us, matmul_ceiling_tflops
    from bench_sparse_mqa_attention import D as HEAD_DIM
    from bench_sparse_mqa_attention import H, make
    from deepinfer_kernels.ops.sparse_mqa_attention import gluon as wide
    from deepinfer_kernels.ops.sparse_mqa_attention.reference import sparse_mqa_attention_ref

    torch.manual_seed(0)
    scale = HEAD_DIM**-0.5

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    q, kv, idx, sinks = make(4, 4096)
    for k in (1, 63, 64, 65, 127, 128, 200, 640):  # odd lengths, -1 slots, a row of -1 only
        i = idx[:, :k].clone()
        i[1, ::3] = -1
        i[2] = -1
        out = launch_pair(q, kv, i, sinks, scale)
        ref = sparse_mqa_attention_ref(q, kv, i, sinks, scale)
        print(f"K={k:4d} rel {rel(out, ref):.2e} all -1 row zero {bool((out[2] == 0).all())}")
    two = launch_pair(q, (kv[:512], kv[512:]), idx, sinks, scale)
    print("two segments bitwise one pool:", torch.equal(two, launch_pair(q, kv, idx, sinks, scale)))
    mm = matmul_ceiling_tflops()
    print(f"{'case':>16} {'wide us':>9} {'pair us':>9} {'speedup':>8} {'pair %bf16':>10} {'rel ref':>8}")
    cases = [(f"decode{b}@{c // 1024}K", make(b, c)) for c in (4096, 32768) for b in (64, 256)]
    q8, kv8, idx8, s8 = make(1, 8192, queries_per_request=8192)
    cases.append(("prefill8K", (q8, kv8, idx8, s8)))
    long = torch.cat([idx8, (torch.rand(8192, 1536, device="cuda") * 8192).long()], dim=1)
    cases.append(("prefill8K_K2176", (q8, kv8, long, s8)))
    for label, (q, kv, idx, sinks) in cases:
        a = (q, kv, idx, sinks, scale)
        sel = torch.randperm(q.shape[0], device="cuda")[:128]
        r = rel(launch_pair(*a)[sel], sparse_mqa_attention_ref(q[sel], kv, idx[sel], sinks, scale))
        tw, tp = graph_us(lambda a=a: wide.launch_wide(*a)), graph_us(lambda a=a: launch_pair(*a))
        tf = 4 * q.shape[0] * H * idx.shape[1] * HEAD_DIM / tp / 1e6
        print(f"{label:>16} {tw:9.1f} {tp:9.1f} {tw / tp:8.2f} {100 * tf / mm:10.1f} {r:8.1e}")


if __name__ == "__main__":
    main()
