"""Microbenchmarks (CUDA) of the decode-step helpers added for in-place reads: ``kv_compress_pool`` (dense groups,
prefill) and ``kv_compress_pool_rows`` (groups read from ring rows in place, decode), ``indexer_topk`` (radix
select vs torch.topk + sort, the reference) and ``engram_gather_rows`` (FP8 rows on the device and in pinned host
memory read in place, vs the reference through the host). GB/s of the bytes each call must move, % of the
device-to-device copy ceiling measured in the same run, and the speed-up over the torch reference.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_kv_compress_engram.py``.
Writes ``benchmarks/results/bench_kv_compress_engram.jsonl``.
"""

import torch
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs
from deepinfer_kernels.ops.engram.reference import engram_gather_rows_ref
from deepinfer_kernels.ops.engram.triton import engram_gather_rows_triton
from deepinfer_kernels.ops.indexer.reference import indexer_topk_ref
from deepinfer_kernels.ops.indexer.triton import indexer_topk_triton
from deepinfer_kernels.ops.kv_compress.reference import kv_compress_pool_ref, kv_compress_pool_rows_ref
from deepinfer_kernels.ops.kv_compress.triton import kv_compress_pool_rows_triton, kv_compress_pool_triton


def main() -> None:
    rec = Recorder("bench_kv_compress_engram")
    ceiling = copy_ceiling_gbs()
    rec.add(case="copy_ceiling", gbs=ceiling)

    def add(case, ms, peer, nbytes, **kw):
        gbs = nbytes / ms / 1e6
        rec.add(case=case, us=ms * 1e3, gbs=gbs, pct_ceiling=100 * gbs / ceiling, torch_us=peer * 1e3,
                speedup_vs_torch=peer / ms, **kw)  # fmt: skip

    for name, slots, c in (("hca", 128, 512), ("csa", 8, 512)):
        for groups in (64, 2048):  # prefill chunks of 8K (HCA) / 16K (CSA) tokens
            kv = torch.randn(groups, slots, c, device="cuda")
            sc = torch.randn(groups, slots, c, device="cuda")
            ms, peer = bench_ms(kv_compress_pool_triton, kv, sc), bench_ms(kv_compress_pool_ref, kv, sc)
            add("kv_compress_pool", ms, peer, 2 * kv.numel() * 4 + groups * c * 4, kind=name, groups=groups)
        for batch in (1, 64, 256):  # a decode step: every request's group in its ring (all complete one here)
            ring = slots + 1
            kv = torch.randn(batch * ring, c * (2 if name == "csa" else 1), device="cuda")
            sc = torch.randn_like(kv)
            rows = (
                torch.arange(batch, device="cuda")[:, None] * ring + torch.arange(slots, device="cuda")
            ).contiguous()
            lead = slots // 2 if name == "csa" else 0
            args = (kv, sc, rows, lead, c)
            ms, peer = bench_ms(kv_compress_pool_rows_triton, *args), bench_ms(kv_compress_pool_rows_ref, *args)
            add("kv_compress_pool_rows", ms, peer, 2 * batch * slots * c * 4 + batch * c * 4, kind=name, batch=batch)

    for b, n in ((1, 1024), (64, 1280), (256, 1280), (1, 8192), (1, 32768)):
        scores = torch.randn(b, 1, n, device="cuda")
        vis = torch.full((b, 1), n, device="cuda")
        ms, peer = bench_ms(indexer_topk_triton, scores, vis, 512), bench_ms(indexer_topk_ref, scores, vis, 512)
        add("indexer_topk", ms, peer, scores.numel() * 4 + b * 512 * 8, batch=b, n=n)

    rows = torch.randn(2_000_000, 256, device="cuda").to(torch.float8_e4m3fn)
    scale = torch.full((2_000_000, 8), 127, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
    for where in ("device", "pinned"):
        r, s = (rows, scale) if where == "device" else (rows.cpu().pin_memory(), scale.cpu().pin_memory())
        for t in (1, 64, 256):
            ids = torch.randint(0, 2_000_000, (t, 24), device="cuda")
            ms = bench_ms(engram_gather_rows_triton, r, s, ids, torch.bfloat16)
            peer = bench_ms(engram_gather_rows_ref, r, s, ids, torch.bfloat16)
            add("engram_gather_rows", ms, peer, t * 24 * (256 + 8 + 512), table=where, tokens=t)


if __name__ == "__main__":
    main()
