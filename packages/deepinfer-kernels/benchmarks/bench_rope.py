"""RoPE microbenchmark (CUDA): the Triton ``rope_interleaved`` vs the plain-torch reference at V4's call sites
(queries [T, 64, 512], keys [T, 512], indexer queries [T, 64, 128]; R = 64, YaRN inv_freq, positions up to
1,000,000), as GB/s and % of the device-to-device copy ceiling measured in the same run, plus the speed-up.

``us`` is the device time of one call (triton.testing.do_bench); ``wall_us`` is the host wall time per call of
200 back-to-back calls (what a host-bound decode step pays: Python, launches, the reference's ~12 kernels).
``mismatch`` counts output elements that are not bit-identical to the reference's.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_rope.py``.
Writes ``benchmarks/results/bench_rope.jsonl``.
"""

import torch
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs, wall_us
from deepinfer_kernels.ops.rope import YarnScaling, rope_inv_freq
from deepinfer_kernels.ops.rope.reference import rope_interleaved_ref
from deepinfer_kernels.ops.rope.triton import rope_interleaved_triton

SITES = {"q": (64, 512), "kv": (512,), "indexer_q": (64, 128)}  # middle dims + D


def main() -> None:
    rec = Recorder("bench_rope")
    ceiling = copy_ceiling_gbs()
    rec.add(case="copy_ceiling", gbs=ceiling)
    inv = rope_inv_freq(64, 160000.0, YarnScaling(16.0, 65536)).cuda()
    table = []
    for site, dims in SITES.items():
        for dtype in (torch.bfloat16, torch.float32):
            for t in (1, 7, 64, 4096):
                x = torch.randn(t, *dims, device="cuda").to(dtype)
                pos = torch.randint(0, 1_000_001, (t,), device="cuda")
                nbytes = 2 * x.numel() * x.element_size() + t * 8 + inv.numel() * 4
                ms = bench_ms(rope_interleaved_triton, x, pos, inv)
                ref_ms = bench_ms(rope_interleaved_ref, x, pos, inv)
                mismatch = int((rope_interleaved_triton(x, pos, inv) != rope_interleaved_ref(x, pos, inv)).sum())
                gbs = nbytes / ms / 1e6
                walls = [wall_us(fn, x, pos, inv, calls=200) for fn in (rope_interleaved_triton, rope_interleaved_ref)]
                row = dict(site=site, shape="x".join(map(str, (t, *dims))), dtype=str(dtype).split(".")[-1],
                           us=ms * 1e3, gbs=gbs, pct_ceiling=100 * gbs / ceiling, ref_us=ref_ms * 1e3,
                           speedup=ref_ms / ms, wall_us=walls[0], ref_wall_us=walls[1], mismatch=mismatch)  # fmt: skip
                rec.add(case="rope_interleaved", **row)
                table.append(row)
    print(f"\n== rope_interleaved (copy ceiling {ceiling:.0f} GB/s)")
    cols = ["site", "shape", "dtype", "us", "ref_us", "speedup", "gbs", "pct_ceiling", "wall_us", "ref_wall_us",
            "mismatch"]  # fmt: skip
    print("  ".join(f"{c:>12}" for c in cols))
    for r in table:
        print("  ".join(f"{r[c]:>12.4g}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols))


if __name__ == "__main__":
    main()
