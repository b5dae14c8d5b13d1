"""Sparse MQA attention microbenchmark (CUDA), V4.1-Flash shapes: 64 heads, head_dim 512, per query
128 window slots + 512 selected slots of a bf16 pool.

Decode at batch 1 / 8 / 64 / 256 with 4K and 32K contexts (each request owns a pool region of its
context length; the window is the region's last 128 rows, the selection random inside it): GB/s of
KV gathered (640 rows x 1 KiB per query) + q + o, as % of the copy ceiling. Prefill of 8K queries
over an 8K context: TFLOP/s (4 * T * H * K * D) as % of the bf16 matmul ceiling. Both backends
(``triton``: fixed split, batch-invariant; ``triton_adaptive``) against a torch eager peer (gather,
bmm, softmax with the sink, bmm), plus a small tile sweep of the kernel at decode batch 64 and in
prefill, to retune the backends' defaults.

``--wide``: only the Gluon wide kernel (``gluon.py``: all 64 heads a program, the rows gathered by cp.async into a
ring of shared buffers) against ``triton_adaptive`` at decode batch 64 / 256 (4K, 32K) and prefill 8K, CUDA-graph
timed, for each (BLOCK_N, NUM_BUF) it can take, with the largest relative difference to the Triton output.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_sparse_mqa_attention.py``.
Writes ``benchmarks/results/bench_sparse_mqa_attention.jsonl``.
"""

import argparse

import torch
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs, graph_us, matmul_ceiling_tflops
from deepinfer_kernels.ops.sparse_mqa_attention import triton as attn

H, D, WINDOW, TOPK = 64, 512, 128, 512
K = WINDOW + TOPK


def make(batch: int, context: int, queries_per_request: int = 1):
    """q [T, H, D], pool [batch * context, D], indices [T, K] int64, sinks [H]."""
    t = batch * queries_per_request
    q = torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(batch * context, D, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(H, device="cuda")
    req = torch.arange(t, device="cuda") // queries_per_request
    base = (req * context).unsqueeze(1)
    pos = torch.randint(WINDOW, context + 1, (t, 1), device="cuda")  # the query's position + 1
    if queries_per_request > 1:  # prefill: query i of a request sits at position i (causal)
        pos = (torch.arange(t, device="cuda") % queries_per_request).unsqueeze(1) + 1
    window = pos - WINDOW + torch.arange(WINDOW, device="cuda")
    window = torch.where(window >= 0, base + window, -1)  # early prefill rows: -1 padding
    picked = base + (torch.rand(t, TOPK, device="cuda") * pos).long()
    return q, kv, torch.cat([window, picked], dim=1), sinks


def torch_peer(q, kv, idx, sinks, scale):
    """Eager torch: gather the rows, bmm, softmax with the sink column, bmm (fp32 softmax)."""
    keys = kv[idx.clamp(min=0)]  # [T, K, D]
    s = torch.bmm(q, keys.transpose(1, 2)).float() * scale  # [T, H, K]
    s = s.masked_fill((idx < 0)[:, None, :], float("-inf"))
    s = torch.cat([s, sinks.view(1, -1, 1).expand(s.shape[0], -1, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1].to(q.dtype)
    return torch.bmm(p, keys)


def main() -> None:
    rec = Recorder("bench_sparse_mqa_attention")
    copy_gbs = copy_ceiling_gbs()
    mm_tflops = matmul_ceiling_tflops()
    rec.add(case="ceilings", copy_gbs=copy_gbs, bf16_matmul_tflops=mm_tflops)
    scale = D**-0.5
    backends = {
        "triton": attn.sparse_mqa_attention_triton,
        "triton_adaptive": attn.sparse_mqa_attention_triton_adaptive,
    }
    for context in (4096, 32768):
        for batch in (1, 8, 64, 256):
            q, kv, idx, sinks = make(batch, context)
            nbytes = batch * K * D * 2 + 2 * q.numel() * 2  # KV rows gathered + q read + o written
            peer = bench_ms(torch_peer, q, kv, idx, sinks, scale)
            for name, fn in backends.items():
                ms = bench_ms(fn, q, kv, idx, sinks, scale)
                gbs = nbytes / ms / 1e6
                rec.add(case="decode", backend=name, batch=batch, context=context, us=ms * 1e3, gbs=gbs,
                        pct_copy=100 * gbs / copy_gbs, torch_us=peer * 1e3, speedup_vs_torch=peer / ms)  # fmt: skip
            del q, kv, idx
    t = 8192
    q, kv, idx, sinks = make(1, t, queries_per_request=t)
    flops = 4 * t * H * K * D
    peer = bench_ms(torch_peer, q, kv, idx, sinks, scale)
    for name, fn in backends.items():
        ms = bench_ms(fn, q, kv, idx, sinks, scale)
        tf = flops / ms / 1e9
        rec.add(case="prefill", backend=name, tokens=t, us=ms * 1e3, tflops=tf, pct_matmul=100 * tf / mm_tflops,
                torch_us=peer * 1e3, speedup_vs_torch=peer / ms)  # fmt: skip
    sweep(rec, copy_gbs, mm_tflops)


def sweep(rec: Recorder, copy_gbs: float, mm_tflops: float) -> None:
    """Tile configs of ``launch`` at decode batch 64 and 256 (split and single pass) and prefill 8K."""
    scale = D**-0.5
    cases = [
        ("decode64", make(64, 32768)),
        ("decode256", make(256, 32768)),
        ("prefill8k", make(1, 8192, queries_per_request=8192)),
    ]
    for label, (q, kv, idx, sinks) in cases:
        t = q.shape[0]
        for split in (None, 128, 256):
            for block_h, block_n, warps, stages in [
                (16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 1), (64, 32, 8, 2),
                (64, 16, 8, 2), (64, 64, 16, 2), (64, 64, 8, 1), (64, 64, 8, 2), (64, 128, 8, 1),
            ]:  # fmt: skip
                if split is not None and split % block_n:
                    continue
                try:
                    tile = dict(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)
                    ms = bench_ms(attn.launch, q, kv, idx, sinks, scale, split=split, **tile)
                except Exception as exc:  # e.g. out of shared memory / registers for a big tile
                    rec.add(case="sweep", label=label, split=split, block_h=block_h, block_n=block_n,
                            warps=warps, stages=stages, error=type(exc).__name__)  # fmt: skip
                    continue
                gbs = (t * K * D * 2 + 2 * q.numel() * 2) / ms / 1e6
                tf = 4 * t * H * K * D / ms / 1e9
                rec.add(case="sweep", label=label, split=split, block_h=block_h, block_n=block_n, warps=warps,
                        stages=stages, us=ms * 1e3, pct_copy=100 * gbs / copy_gbs,
                        pct_matmul=100 * tf / mm_tflops)  # fmt: skip


WIDE_TILINGS = [(64, 2, False), (64, 2, True), (32, 4, False), (32, 4, True), (32, 3, False)]  # BLOCK_N, NUM_BUF, DUP_S


def wide_table() -> None:
    from deepinfer_kernels.ops.sparse_mqa_attention import gluon as wide

    rec = Recorder("bench_sparse_mqa_attention_wide")
    copy_gbs, mm_tflops = copy_ceiling_gbs(), matmul_ceiling_tflops()
    rec.add(case="ceilings", copy_gbs=copy_gbs, bf16_matmul_tflops=mm_tflops)
    print(f"ceilings: copy {copy_gbs:.0f} GB/s, bf16 {mm_tflops:.0f} TFLOP/s")
    names = [f"g{bn}x{nb}" + ("dup" if dup else "") for bn, nb, dup in WIDE_TILINGS]
    print(f"{'case':>14} {'triton_us':>10} " + " ".join(f"{n:>10}" for n in names)
          + f" {'best_%copy':>10} {'best_%bf16':>10} {'max_rel':>8}")  # fmt: skip
    scale = D**-0.5
    cases = [(f"decode{b}@{c // 1024}K", make(b, c)) for c in (4096, 32768) for b in (64, 256)]
    cases.append(("prefill8K", make(1, 8192, queries_per_request=8192)))
    for label, args in cases:
        t = args[0].shape[0]
        a = (*args, scale)
        ref = attn.sparse_mqa_attention_triton_adaptive(*a).float()
        base = graph_us(lambda a=a: attn.sparse_mqa_attention_triton_adaptive(*a))
        times, worst = [], 0.0
        for bn, nb, dup in WIDE_TILINGS:
            cfg = dict(block_n=bn, num_buf=nb, dup_s=dup)
            out = wide.launch_wide(*a, **cfg).float()
            worst = max(worst, ((out - ref).norm() / ref.norm()).item())
            times.append(graph_us(lambda a=a, cfg=cfg: wide.launch_wide(*a, **cfg)))
        best = min(times)
        gbs = (t * K * D * 2 + 2 * args[0].numel() * 2) / best / 1e3
        tf = 4 * t * H * K * D / best / 1e6
        rec.add(case="wide", label=label, triton_us=base, gluon_us=dict(zip(names, times)),
                best_pct_copy=100 * gbs / copy_gbs, best_pct_bf16=100 * tf / mm_tflops, max_rel=worst)  # fmt: skip
        print(f"{label:>14} {base:>10.1f} " + " ".join(f"{x:>10.1f}" for x in times)
              + f" {100 * gbs / copy_gbs:>10.1f} {100 * tf / mm_tflops:>10.1f} {worst:>8.1e}")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wide", action="store_true", help="only the Gluon wide kernel against triton_adaptive")
    if ap.parse_args().wide:
        wide_table()
    else:
        main()
