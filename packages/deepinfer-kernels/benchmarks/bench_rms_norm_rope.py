"""rms_norm_rope microbenchmark (CUDA): the fused Triton kernel vs the Triton ``rms_norm`` followed by the Triton
``rope_interleaved`` (what the models ran before), and vs the plain-torch reference, at the V4 / V4.1 call sites
(V4's per-head query norm [T, 64, 512] unweighted, the window KV and compressor entries [T, 512], V4.1's index keys
[T, 128]; R = 64, bf16), decode and prefill sizes. ``us`` / ``two_ops_us`` are device times per call from CUDA
graphs (a decode step's view, no launch overhead); GB/s counts reading x and writing y once, against the
device-to-device copy ceiling measured in the same run. ``mismatch`` counts elements that differ from the two
kernels' result (the fused op promises none).

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_rms_norm_rope.py``.
Writes ``benchmarks/results/bench_rms_norm_rope.jsonl``.
"""

import torch
from _bench_util import Recorder, copy_ceiling_gbs, graph_us
from deepinfer_kernels.ops.rms_norm.triton import rms_norm_triton
from deepinfer_kernels.ops.rms_norm_rope.reference import rms_norm_rope_ref
from deepinfer_kernels.ops.rms_norm_rope.triton import rms_norm_rope_triton
from deepinfer_kernels.ops.rope import YarnScaling, rope_inv_freq
from deepinfer_kernels.ops.rope.triton import rope_interleaved_triton

SITES = {"v4_query": ((64, 512), False), "kv_entry": ((512,), True), "v41_index_key": ((128,), True)}


def two_ops(x, w, eps, pos, inv):
    return rope_interleaved_triton(rms_norm_triton(x, w, eps), pos, inv)


def main() -> None:
    rec = Recorder("bench_rms_norm_rope")
    ceiling = copy_ceiling_gbs()
    rec.add(case="copy_ceiling", gbs=ceiling)
    inv = rope_inv_freq(64, 160000.0, YarnScaling(16.0, 65536)).cuda()
    for site, (dims, weighted) in SITES.items():
        for t in (1, 8, 256, 8192):
            x = torch.randn(t, *dims, device="cuda").to(torch.bfloat16)
            w = 1 + 0.1 * torch.randn(dims[-1], device="cuda") if weighted else None
            pos = torch.randint(0, 1_000_001, (t,), device="cuda")
            us = graph_us(lambda: rms_norm_rope_triton(x, w, 1e-6, pos, inv))  # noqa: B023
            two_us = graph_us(lambda: two_ops(x, w, 1e-6, pos, inv))  # noqa: B023
            ref_us = graph_us(lambda: rms_norm_rope_ref(x, w, 1e-6, pos, inv))  # noqa: B023
            mismatch = int((rms_norm_rope_triton(x, w, 1e-6, pos, inv) != two_ops(x, w, 1e-6, pos, inv)).sum())
            gbs = 2 * x.numel() * x.element_size() / us / 1e3
            rec.add(case="rms_norm_rope", site=site, shape="x".join(map(str, (t, *dims))), us=us, two_ops_us=two_us,
                    ref_us=ref_us, speedup_vs_two_ops=two_us / us, speedup_vs_ref=ref_us / us, gbs=gbs,
                    pct_ceiling=100 * gbs / ceiling, mismatch=mismatch)  # fmt: skip


if __name__ == "__main__":
    main()
