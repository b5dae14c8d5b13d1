"""topk_select microbenchmark (CUDA): Triton radix select vs torch.topk at the indexer's k = 512 over
N = 8K / 32K / 128K compressed entries, rows = 1 / 8 / 64 / 256 queries; GB/s of scores read (one
pass counted, though the kernel streams the row five times) as % of the copy ceiling, and the ratio
to torch.topk (which returns unsorted values + indices and applies no masking; our op also sorts and
pads).

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_topk_select.py``.
Writes ``benchmarks/results/bench_topk_select.jsonl``.
"""

import torch
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs
from deepinfer_kernels.ops.topk_select.triton import topk_select_triton

K = 512


def main() -> None:
    rec = Recorder("bench_topk_select")
    ceiling = copy_ceiling_gbs()
    rec.add(case="copy_ceiling", gbs=ceiling)
    for n in (8192, 32768, 131072):
        for rows in (1, 8, 64, 256):
            x = torch.relu(torch.randn(rows, n, device="cuda"))  # ReLU-like indexer scores (many zeros)
            lengths = torch.full((rows,), n, dtype=torch.int64, device="cuda")
            ms = bench_ms(topk_select_triton, x, K, lengths)
            peer = bench_ms(torch.topk, x, K, dim=-1, sorted=False)
            gbs = x.numel() * 4 / ms / 1e6
            rec.add(case="topk", n=n, rows=rows, k=K, us=ms * 1e3, gbs=gbs, pct_ceiling=100 * gbs / ceiling,
                    torch_topk_us=peer * 1e3, speedup_vs_torch=peer / ms)  # fmt: skip
    sweep(rec)


def sweep(rec: Recorder) -> None:
    """Chunk size and warps of the kernel, at 1 and 64 rows (latency vs throughput)."""
    for n in (32768, 131072):
        for rows in (1, 64):
            x = torch.relu(torch.randn(rows, n, device="cuda"))
            for block in (2048, 4096, 8192, 16384):
                for warps in (4, 8, 16):
                    ms = bench_ms(topk_select_triton, x, K, None, block=block, num_warps=warps)
                    rec.add(case="sweep", n=n, rows=rows, block=block, warps=warps, us=ms * 1e3)


if __name__ == "__main__":
    main()
