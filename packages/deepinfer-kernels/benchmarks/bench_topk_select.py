"""topk_select microbenchmark (CUDA): Triton radix select vs torch.topk at the indexer's k = 512 over
N = 8K / 32K / 128K compressed entries, rows = 1 / 8 / 64 / 256 queries; GB/s of scores read (one
pass counted, though the kernel streams the row five times) as % of the copy ceiling, and the ratio
to torch.topk (which returns unsorted values + indices and applies no masking; our op also sorts and
pads). Then the decode indexer's rows (N = 1K / 4K / 8K: context / ratio at 4K-32K tokens) replayed from CUDA
graphs, the register-resident kernel against the streaming one (``block_row_max=0``) and torch.topk, and a sweep
of the register kernel's warps. ``--long``: only the decode indexer's long rows (N = 8K: V4 at 32K tokens; 16K /
32K: V4.1's ratio-2 and ratio-1 sources at 32K tokens), in CUDA graphs: the split kernel (pieces of 4096 / 2048
entries, forced) against the stream (at 8K: the register kernel) and torch.topk, with a table. ``--buckets``: the
decode rows at the widths a step has them (bucketed block tables: 5120 entries at 4K tokens, 33792 at 32K), the
registers as a power of two plus a tail against the next power of two, with a table. ``--model``: the 32K rows
as the models pass them (lengths, V4.1's candidate mask, indexer-like scores), warm and cold (after an L2 flush).
``--grid``: the grid kernel's piece sizes against the kernel a decode row takes without it. ``--row-map``: a CSA
decode step's attention row table, made by ``indexer_topk`` with a ``row_map`` against the top-k then ``paged_rows``.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_topk_select.py [--long |
--buckets | --model | --grid | --row-map]``.
Writes ``benchmarks/results/bench_topk_select.jsonl``.
"""

import argparse

import torch
import triton
from _bench_util import Recorder, bench_ms, cold_us, copy_ceiling_gbs, graph_us
from deepinfer_kernels.ops.topk_select import triton as backend
from deepinfer_kernels.ops.topk_select.triton import topk_select_triton

K = 512


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", action="store_true", help="only the decode rows past the register kernel")
    ap.add_argument("--buckets", action="store_true", help="only the decode rows at bucketed widths: tail vs pow2")
    ap.add_argument("--model", action="store_true", help="only the 32K decode rows as the models pass them")
    ap.add_argument("--grid", action="store_true", help="only the grid kernel's pieces on the decode rows")
    ap.add_argument("--row-map", action="store_true", help="only the top-k writing the attention row table")
    args = ap.parse_args()
    rec = Recorder("bench_topk_select")
    if args.row_map:
        row_map_rows(rec)
        return
    if args.grid:
        grid_rows(rec)
        return
    if args.model:
        model_rows(rec)
        return
    if args.buckets:
        bucket_rows(rec)
        return
    if args.long:
        long_rows(rec)
        return
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
    decode_rows(rec)
    sweep(rec)


def decode_rows(rec: Recorder) -> None:
    """Rows the register kernel serves, in CUDA graphs (a decode step's view): register vs stream vs torch.topk."""
    for n in (1024, 4096, 8192):
        for rows in (1, 8, 64, 256):
            x = torch.relu(torch.randn(rows, n, device="cuda"))
            lengths = torch.full((rows,), n, dtype=torch.int64, device="cuda")
            reg = graph_us(lambda x=x, lengths=lengths: topk_select_triton(x, K, lengths))
            stream = graph_us(lambda x=x, lengths=lengths: topk_select_triton(x, K, lengths, block_row_max=0))
            peer = graph_us(lambda x=x: torch.topk(x, K, dim=-1, sorted=False))
            same = torch.equal(topk_select_triton(x, K, lengths), topk_select_triton(x, K, lengths, block_row_max=0))
            rec.add(case="decode_rows", n=n, rows=rows, register_us=reg, stream_us=stream, torch_topk_us=peer,
                    same_rows=same)  # fmt: skip
    saved = backend.register_parts
    for n in (1024, 4096, 8192):
        x = torch.relu(torch.randn(1, n, device="cuda"))
        for warps in (2, 4, 8, 16, 32):
            backend.register_parts = lambda m, mw=1, w=warps: (*saved(m)[:2], w)
            try:
                rec.add(
                    case="register_warps", n=n, rows=1, warps=warps, us=graph_us(lambda x=x: topk_select_triton(x, K))
                )
            finally:
                backend.register_parts = saved


def powers_of_two(n: int, min_warps: int = 1) -> tuple[int, int, int]:
    """``register_parts`` without a tail (before session 19): the next power of two."""
    full = max(128, triton.next_power_of_2(n))
    return full, 0, max(min_warps, backend.block_warps(full))


def bucket_rows(rec: Recorder) -> None:
    """The decode indexer's rows as a step has them (as wide as its block tables, bucketed to 8 blocks of 128
    tokens: 4K tokens -> 5120 entries at ratio 1, 2560 at ratio 2, 1280 at ratio 4; 32K -> 33792 / 16896 / 8448), in
    CUDA graphs: the registers as a power of two plus a tail (``register_parts``) against the next power of two, and
    the split kernel forced at every row count (4096-entry pieces; ``SPLIT_MAX_PROGRAMS`` decides where it serves)."""
    print(f"{'N':>6} {'rows':>5} {'tail':>8} {'pow2':>8} {'split':>8} {'torch':>8}  (us)")
    forced = dict(block_row_max=0, split_programs=1 << 20)
    saved = backend.register_parts
    for n in (1280, 2560, 5120, 8448, 16896, 33792):
        for rows in (1, 8, 64, 256):
            x = torch.relu(torch.randn(rows, n, device="cuda"))
            lengths = torch.full((rows,), n - 1023, dtype=torch.int64, device="cuda")  # the visible entries
            us = {"tail": graph_us(lambda x=x, ln=lengths: topk_select_triton(x, K, ln))}
            want = topk_select_triton(x, K, lengths)
            backend.register_parts = powers_of_two
            try:
                us["pow2"] = graph_us(lambda x=x, ln=lengths: topk_select_triton(x, K, ln))
                same = torch.equal(topk_select_triton(x, K, lengths), want)
            finally:
                backend.register_parts = saved
            us["split"] = graph_us(lambda x=x, ln=lengths: topk_select_triton(x, K, ln, **forced))
            same = same and torch.equal(topk_select_triton(x, K, lengths, **forced), want)
            us["torch"] = graph_us(lambda x=x: torch.topk(x, K, dim=-1, sorted=False))
            rec.add(case="bucket_rows", n=n, rows=rows, same_rows=same, **{f"{k}_us": v for k, v in us.items()})
            print(
                f"{n:>6} {rows:>5} "
                + " ".join(f"{us[k]:>8.1f}" for k in ("tail", "pow2", "split", "torch"))
                + f"  same={same}"
            )


def long_rows(rec: Recorder) -> None:
    """The decode indexer's long rows, in CUDA graphs: the split kernel (two piece sizes, forced at every row
    count) vs the kernel it would replace (the register kernel at 8K, else the stream) vs torch.topk."""
    print(f"{'N':>6} {'rows':>5} {'split4096':>10} {'split2048':>10} {'other':>8} {'torch':>8}  (us)")
    forced = dict(block_row_max=0, split_programs=1 << 20)
    for n in (8192, 16384, 32768):
        other = {} if n <= 8192 else {"chunk": 0}
        for rows in (1, 8, 64, 256):
            x = torch.relu(torch.randn(rows, n, device="cuda"))
            lengths = torch.full((rows,), n, dtype=torch.int64, device="cuda")
            us = {
                f"split{c}": graph_us(lambda x=x, ln=lengths, c=c: topk_select_triton(x, K, ln, chunk=c, **forced))
                for c in (4096, 2048)
            }
            us["other"] = graph_us(lambda x=x, ln=lengths, o=other: topk_select_triton(x, K, ln, **o))
            us["torch"] = graph_us(lambda x=x: torch.topk(x, K, dim=-1, sorted=False))
            same = torch.equal(topk_select_triton(x, K, lengths, **forced), topk_select_triton(x, K, lengths, **other))
            rec.add(case="long_rows", n=n, rows=rows, same_rows=same, **{f"{k}_us": v for k, v in us.items()})
            print(f"{n:>6} {rows:>5} " + " ".join(f"{us[k]:>10.1f}" for k in ("split4096", "split2048"))
                  + f" {us['other']:>8.1f} {us['torch']:>8.1f}  same={same}")  # fmt: skip


def model_rows(rec: Recorder) -> None:
    """The 32K decode rows as the models call ``indexer_topk`` (CUDA graphs, 1 / 8 rows): V4's 8448-entry rows with
    8192 visible, V4.1's 33792-entry rows with 32768 visible and, on its re-index layers, the candidate mask of the
    top 2048 blocks of 8 (``candidate_block_mask``), on scores shaped like the indexer's (a sum of weighted ReLUs:
    positive, continuous) and on ReLU'd normal scores; warm (``graph_us``) and cold (``cold_us``: each call after a
    256 MB copy, as in a decode step, where the weight streams evict the kernel's code from the L2). Session 21's
    graph-step timelines had one split call at 40 (V4) / 50-66 (V4.1) us against ~23 / 35 us warm: lengths, mask
    and score shape changed nothing (session 22, H200), the cold code did (V4.1's split kernel, then 14K SASS
    instructions: 34 us warm, 59 cold; with the radix passes as a runtime loop, 7K: 28 / 28)."""
    from deepinfer_kernels.ops.indexer import candidate_block_mask, indexer_topk

    print(f"{'case':>24} {'rows':>5} {'scores':>8} {'warm':>8} {'cold':>8}  (us)")
    for name, n, vis, masked in (("v4 8448", 8448, 8192, False), ("v4.1 33792", 33792, 32768, False),
                                 ("v4.1 33792 + cand mask", 33792, 32768, True)):  # fmt: skip
        for rows in (1, 8):
            for dist in ("indexer", "relu"):
                g = torch.Generator(device="cuda").manual_seed(rows)
                if dist == "indexer":  # sum over 64 heads of w_h relu(q_h . k): 64 x 128 dims, fp32
                    q = torch.randn(rows, 64, 128, device="cuda", generator=g)
                    k = torch.randn(n, 128, device="cuda", generator=g)
                    w = torch.rand(rows, 64, device="cuda", generator=g)
                    x = torch.einsum("rh,rhn->rn", w, torch.relu(torch.einsum("rhd,nd->rhn", q, k))) * 128**-0.5
                else:
                    x = torch.relu(torch.randn(rows, n, device="cuda", generator=g))
                visible = torch.full((1, rows), vis, dtype=torch.int64, device="cuda")
                mask = candidate_block_mask(x[None], visible, 8, 2048) if masked else None
                warm = graph_us(lambda x=x, v=visible, m=mask: indexer_topk(x[None], v, K, m))
                cold = cold_us(lambda x=x, v=visible, m=mask: indexer_topk(x[None], v, K, m))
                rec.add(case="model_rows", name=name, rows=rows, scores=dist, warm_us=warm, cold_us=cold)
                print(f"{name:>24} {rows:>5} {dist:>8} {warm:>8.1f} {cold:>8.1f}")


def grid_rows(rec: Recorder) -> None:
    """The grid kernel (a row's pieces in one selection, a grid barrier per radix pass) against what the row takes
    without it (the register kernel up to 8K entries, the split kernel past it) on the decode rows: V4's at 8K / 32K
    tokens (2048 / 8448 entries, 1 / 8 rows) and V4.1's (5120 / 33792), warm and cold, per piece size (``auto``: as
    dispatched); same: bitwise the rows of the kernel without it. A table last."""
    print(f"{'n':>6} {'rows':>5} {'kernel':>16} {'warm':>8} {'cold':>8}  (us)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = []
    for n, vis in ((2048, 2048), (4096, 4096), (5120, 4096), (8448, 8192), (33792, 32768)):
        for rows in (1, 8):
            g = torch.Generator(device="cuda").manual_seed(n + rows)
            x = torch.relu(torch.randn(rows, n, generator=g, device="cuda"))
            lengths = torch.full((rows,), vis, dtype=torch.int64, device="cuda")
            base = topk_select_triton(x, K, lengths, grid_chunk=0)
            cases = {"without": dict(grid_chunk=0), "auto": {}}
            for chunk in backend.GRID_CHUNKS:
                if backend.grid_plan(n, rows, sms, chunk):
                    cases[f"grid{chunk}"] = dict(grid_min=0, grid_chunk=chunk)
            for name, kw in cases.items():
                same = torch.equal(topk_select_triton(x, K, lengths, **kw), base)
                warm = graph_us(lambda kw=kw, x=x, ln=lengths: topk_select_triton(x, K, ln, **kw))
                cold = cold_us(lambda kw=kw, x=x, ln=lengths: topk_select_triton(x, K, ln, **kw))
                rec.add(case="grid_rows", n=n, rows=rows, kernel=name, warm_us=warm, cold_us=cold, same=same)
                table.append(f"{n:>6} {rows:>5} {name:>16} {warm:>8.1f} {cold:>8.1f}  same={same}")
                print(table[-1], flush=True)
    print("\n== topk_select k = 512, grid kernel vs without (us)")
    print("\n".join(table))


def row_map_rows(rec: Recorder, timer=None) -> None:
    """A V4 CSA decode step's attention row table [window rows | pool rows of the picks] (1 / 8 requests, 1024 /
    8448 entries: 4K / 32K tokens; a 128-row window prefix; 64 entries a block, each request its own table): the
    top-k with ``row_map`` (one launch) against the top-k then ``paged_rows`` (two), warm and cold (``graph_us`` /
    ``cold_us``; ``timer``: (warm, cold) callables, for a smoke run), and whether the two tables are the same bits.
    A table last."""
    from deepinfer_kernels.ops.cache_rows import paged_rows
    from deepinfer_kernels.ops.indexer import indexer_topk

    warm_of, cold_of = timer or (graph_us, cold_us)
    dev = "cuda" if timer is None else "cpu"
    table = []
    for n, vis in ((1024, 1024), (8448, 8192)):
        for rows in (1, 8):
            g = torch.Generator(device=dev).manual_seed(n + rows)
            x = torch.relu(torch.randn(rows, 1, n, generator=g, device=dev))
            visible = torch.full((rows, 1), vis, dtype=torch.int64, device=dev)
            blocks = -(-n // 64)
            tables = torch.randperm(rows * blocks * 2, generator=g, device=dev)[: rows * blocks].view(rows, blocks)
            prefix = torch.randint(0, 1 << 20, (rows, 128), generator=g, device=dev)
            row_map = (tables, 64, 128 * rows, prefix)

            def fused(x=x, v=visible, m=row_map):
                return indexer_topk(x, v, K, row_map=m)[:, 0]

            def two(x=x, v=visible, t=tables, p=prefix, rows=rows):
                return paged_rows(indexer_topk(x, v, K)[:, 0], t, 64, 128 * rows, prefix=p)

            same = torch.equal(fused(), two())
            for name, fn in (("top-k + paged_rows", two), ("top-k with row_map", fused)):
                warm, cold = warm_of(fn), cold_of(fn)
                rec.add(case="row_map", n=n, rows=rows, impl=name, warm_us=warm, cold_us=cold, same=same)
                table.append(f"{n:>6} {rows:>5} {name:>20} {warm:>8.1f} {cold:>8.1f}  same={same}")
                print(table[-1], flush=True)
    print("\n== a CSA decode step's attention row table, k = 512 (us)")
    print(f"{'n':>6} {'rows':>5} {'impl':>20} {'warm':>8} {'cold':>8}")
    print("\n".join(table))


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
