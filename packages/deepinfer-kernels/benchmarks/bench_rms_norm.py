"""RMSNorm microbenchmark (CUDA): the Triton backend vs the plain-torch reference, as GB/s and % of
the device-to-device copy ceiling measured in the same run.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_rms_norm.py``.
Writes ``benchmarks/results/bench_rms_norm.jsonl``.
"""

import torch
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs
from deepinfer_kernels.ops.rms_norm.reference import rms_norm_ref
from deepinfer_kernels.ops.rms_norm.triton import rms_norm_triton


def main() -> None:
    rec = Recorder("bench_rms_norm")
    ceiling = copy_ceiling_gbs()
    rec.add(case="copy_ceiling", gbs=ceiling)
    for d in (512, 4096, 7168):
        w = torch.randn(d, device="cuda")
        for rows in (1, 8, 64, 256, 8192, 65536):
            x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
            nbytes = 2 * x.numel() * 2 + d * 4  # read x, write y (bf16), read the fp32 weight
            ms = bench_ms(rms_norm_triton, x, w, 1e-6)
            peer = bench_ms(rms_norm_ref, x, w, 1e-6)
            gbs = nbytes / ms / 1e6
            rec.add(case="rms_norm", d=d, rows=rows, us=ms * 1e3, gbs=gbs, pct_ceiling=100 * gbs / ceiling,
                    torch_us=peer * 1e3, speedup_vs_torch=peer / ms)  # fmt: skip


if __name__ == "__main__":
    main()
