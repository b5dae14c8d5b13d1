"""candidate_block_mask microbenchmark (CUDA): V4.1's level-one pre-filter (blocks of 8, budget 2048 blocks) at the
decode step's rows (1 / 8 / 64 / 256 queries) over N = 4K / 16K (the budget holds every block: one launch) and 32K /
128K entries (a top-2048 of the block scores: three launches), replayed from CUDA graphs (a decode step's view), the
Triton backend against the PyTorch reference on the GPU (what the model ran before); GB/s of scores read plus mask
written, as % of the copy ceiling. Every configuration also checks the two masks equal.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_candidate_block_mask.py``.
Writes ``benchmarks/results/bench_candidate_block_mask.jsonl``.
"""

import torch
from _bench_util import Recorder, copy_ceiling_gbs, graph_us
from deepinfer_kernels.ops.indexer.candidate_triton import candidate_block_mask_triton
from deepinfer_kernels.ops.indexer.reference import candidate_block_mask_ref

BLOCK_SIZE, TOP_BLOCKS = 8, 2048


def main() -> None:
    rec = Recorder("bench_candidate_block_mask")
    ceiling = copy_ceiling_gbs()
    rec.add(case="copy_ceiling", gbs=ceiling)
    for n in (4096, 16384, 32768, 131072):
        for rows in (1, 8, 64, 256):
            scores = torch.relu(torch.randn(rows, 1, n, device="cuda"))  # ReLU-like indexer scores
            visible = torch.randint(n // 2, n + 1, (rows, 1), device="cuda")
            same = torch.equal(
                candidate_block_mask_triton(scores, visible, BLOCK_SIZE, TOP_BLOCKS),
                candidate_block_mask_ref(scores, visible, BLOCK_SIZE, TOP_BLOCKS),
            )
            ours = graph_us(lambda s=scores, v=visible: candidate_block_mask_triton(s, v, BLOCK_SIZE, TOP_BLOCKS))
            peer = graph_us(lambda s=scores, v=visible: candidate_block_mask_ref(s, v, BLOCK_SIZE, TOP_BLOCKS))
            gbs = rows * n * 5 / ours / 1e3  # 4 bytes of score read, 1 of mask written
            rec.add(case="decode_rows", n=n, rows=rows, us=ours, reference_us=peer, speedup=peer / ours, gbs=gbs,
                    pct_ceiling=100 * gbs / ceiling, same_mask=same)  # fmt: skip


if __name__ == "__main__":
    main()
