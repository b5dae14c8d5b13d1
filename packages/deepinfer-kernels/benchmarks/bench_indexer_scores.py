"""indexer_scores microbenchmark (CUDA), V4.1-Flash indexer shape (32 heads x 128, bf16 q / k): the
Triton backend vs a torch eager peer (einsum on tensor cores, ReLU, weighted head sum). Decode: S =
1 / 8 / 64 / 256 queries against N = 8K / 32K / 128K keys (GB/s of keys read, % of the copy
ceiling); prefill: 8K queries x 8K keys (TFLOP/s, % of the bf16 matmul ceiling). Paged decode
(``indexer_scores_paged``, what a decode step runs): B = 64 / 256 requests of one query each, 1K-8K keys per
request read through block tables, V4.1's 32 heads and V4's 64, against the same torch peer on the gathered keys.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_indexer_scores.py``.
Writes ``benchmarks/results/bench_indexer_scores.jsonl``.
"""

import torch
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs, matmul_ceiling_tflops
from deepinfer_kernels.ops.indexer.triton import indexer_scores_paged_triton, indexer_scores_triton

H, DH = 32, 128
SCALE = DH**-0.5


def torch_peer(q, k, w):
    logits = torch.einsum("bshd,bnd->bsnh", q, k).float()  # bf16 tensor-core matmul, fp32 out
    return (torch.relu(logits) * SCALE * w[:, :, None, :]).sum(-1)


def paged_peer(q, pool, tables, w):
    """The torch peer of a paged call: gather every request's key blocks, then ``torch_peer``."""
    return torch_peer(q, pool[tables].flatten(1, 2), w)


def main() -> None:
    rec = Recorder("bench_indexer_scores")
    copy_gbs = copy_ceiling_gbs()
    mm = matmul_ceiling_tflops()
    rec.add(case="ceilings", copy_gbs=copy_gbs, bf16_matmul_tflops=mm)
    cases = [(s, n) for n in (8192, 32768, 131072) for s in (1, 8, 64, 256)] + [(8192, 8192)]
    for s, n in cases:
        q = torch.randn(1, s, H, DH, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, n, DH, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(1, s, H, device="cuda")
        ms = bench_ms(indexer_scores_triton, q, k, w, SCALE)
        peer = bench_ms(torch_peer, q, k, w) if s * n * H <= (1 << 32) else float("nan")
        nbytes = k.numel() * 2 + q.numel() * 2 + s * n * 4
        tf = 2 * s * n * H * DH / ms / 1e9
        rec.add(case="indexer_scores", s=s, n=n, us=ms * 1e3, gbs=nbytes / ms / 1e6,
                pct_copy=100 * nbytes / ms / 1e6 / copy_gbs, tflops=tf, pct_matmul=100 * tf / mm,
                torch_us=peer * 1e3, speedup_vs_torch=peer / ms)  # fmt: skip
    for h, n, rpb in ((32, 1024, 32), (32, 2048, 64), (32, 4096, 128), (32, 8192, 32), (64, 1024, 32)):
        for b in (64, 256):
            nblk = n // rpb
            pool = torch.randn(b * nblk, rpb, DH, device="cuda", dtype=torch.bfloat16)
            tables = torch.randperm(b * nblk, device="cuda").view(b, nblk)
            q = torch.randn(b, 1, h, DH, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(b, 1, h, device="cuda")
            ms = bench_ms(indexer_scores_paged_triton, q, pool, tables, w, SCALE)
            peer = bench_ms(paged_peer, q, pool, tables, w)
            nbytes = pool.numel() * 2 + q.numel() * 2 + b * n * 4
            rec.add(case="indexer_scores_paged", heads=h, b=b, n=n, rows_per_block=rpb, us=ms * 1e3,
                    gbs=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / copy_gbs, torch_us=peer * 1e3,
                    speedup_vs_torch=peer / ms)  # fmt: skip


if __name__ == "__main__":
    main()
