"""Microbenchmarks (CUDA) of the small per-layer ops that Triton now runs in one launch each (session 6): the MoE
router ``moe_route_topk``, the V4.1 activation fake quantisers ``fake_quant_fp8_ue8m0`` / ``fake_quant_e2m1``, the
Engram ``engram_gate_inject`` and the decode-step row ids ``ring_rows`` / ``paged_rows``, against their torch
references (chains of 5 to 40 small kernels). At decode sizes these ops are launch-bound, so each is timed twice:
device time per call (``bench_ms``) and host wall time per call (``wall_us``, what an eager step pays); at prefill
sizes GB/s of the bytes each call must move, as % of the device-to-device copy ceiling measured in the same run.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_step_small_ops.py``.
Writes ``benchmarks/results/bench_step_small_ops.jsonl``.
"""

import torch
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs, wall_us
from deepinfer_kernels.ops.cache_rows.reference import paged_rows_ref, ring_rows_ref
from deepinfer_kernels.ops.cache_rows.triton import paged_rows_triton, ring_rows_triton
from deepinfer_kernels.ops.engram.reference import engram_gate_inject_ref
from deepinfer_kernels.ops.engram.triton import engram_gate_inject_triton
from deepinfer_kernels.ops.moe.reference import moe_route_topk_ref
from deepinfer_kernels.ops.moe.route_triton import moe_route_topk_triton
from deepinfer_kernels.ops.quant.fake_quant_triton import fake_quant_e2m1_triton, fake_quant_fp8_ue8m0_triton
from deepinfer_kernels.ops.quant.reference import fake_quant_e2m1_ref, fake_quant_fp8_ue8m0_ref


def main() -> None:
    rec = Recorder("bench_step_small_ops")
    ceiling = copy_ceiling_gbs()
    rec.add(case="copy_ceiling", gbs=ceiling)
    dev = "cuda"

    def add(case, ours, peer, args, nbytes, **kw):
        ms, peer_ms = bench_ms(ours, *args), bench_ms(peer, *args)
        row = dict(us=ms * 1e3, torch_us=peer_ms * 1e3, speedup_vs_torch=peer_ms / ms,
                   wall_us=wall_us(ours, *args), torch_wall_us=wall_us(peer, *args))  # fmt: skip
        gbs = nbytes / ms / 1e6
        rec.add(case=case, gbs=gbs, pct_ceiling=100 * gbs / ceiling, **row, **kw)

    def route(ours):
        impl = moe_route_topk_triton if ours else moe_route_topk_ref
        return lambda logits, bias: impl(logits, bias, 6, route_scale=1.5)

    for t in (1, 256, 8192):  # V4.1-Flash router: 384 experts, top-6
        logits, bias = torch.randn(t, 384, device=dev), torch.randn(384, device=dev) * 0.1
        add("moe_route_topk", route(True), route(False), (logits, bias), logits.numel() * 4 + t * 6 * 12, tokens=t)
    for t in (1, 256, 8192):  # V4.1 window KV (FP8 / 32), compressed KV (E2M1 / E4M3 16), index keys (E2M1 / 32)
        for name, d, ours, peer in (
            ("fake_quant_fp8_ue8m0", 512, lambda x: fake_quant_fp8_ue8m0_triton(x, 32),
             lambda x: fake_quant_fp8_ue8m0_ref(x, 32)),
            ("fake_quant_e2m1_e4m3", 512, lambda x: fake_quant_e2m1_triton(x, 16, "e4m3"),
             lambda x: fake_quant_e2m1_ref(x, 16, "e4m3")),
            ("fake_quant_e2m1_ue8m0", 128, lambda x: fake_quant_e2m1_triton(x, 32, "ue8m0"),
             lambda x: fake_quant_e2m1_ref(x, 32, "ue8m0")),
        ):  # fmt: skip
            x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
            add(name, ours, peer, (x,), 2 * x.numel() * 2, tokens=t)
    for t in (1, 8192):  # V4.1 Engram gate: 4 streams of 5120, key and value views of one projection
        x = torch.randn(t, 4, 5120, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(t, 5, 5120, device=dev, dtype=torch.bfloat16)
        w = torch.randn(4, 5120, device=dev)
        args = (x, kv[:, :4], kv[:, 4], w, None)
        add("engram_gate_inject", engram_gate_inject_triton, engram_gate_inject_ref, args,
            (3 * x.numel() + kv[:, :4].numel() + kv[:, 4].numel()) * 2, tokens=t)  # fmt: skip
    for b in (1, 256):  # decode row ids: a 128-row window, then 512 picked entries through 64-block tables
        pos = torch.randint(200, 4000, (b,), device=dev)
        slots, first = torch.arange(b, device=dev), pos - 100
        add("ring_rows", lambda p, s, f: ring_rows_triton(p, s, f, 130, 128),
            lambda p, s, f: ring_rows_ref(p, s, f, 130, 128), (pos, slots, first), b * 128 * 8 + 3 * b * 8,
            batch=b)  # fmt: skip
        ids = torch.randint(-1, 1024, (b, 512), device=dev)
        tables = torch.randint(0, 4096, (b, 64), device=dev)
        add("paged_rows", lambda i, tb: paged_rows_triton(i, tb, 16, 128), lambda i, tb: paged_rows_ref(i, tb, 16, 128),
            (ids, tables), 2 * ids.numel() * 8 + tables.numel() * 8, batch=b)  # fmt: skip


if __name__ == "__main__":
    main()
