"""Programmatic dependent launch microbenchmark (CUDA, sm_90+): what ``pdl_options`` saves per kernel boundary.

A CUDA graph of 200 dependent one-program kernels (an RMSNorm-like row kernel over 4096 bf16 columns, each reading
the previous one's output; with ``--gemm-every 4`` every fourth launch is a 4096 x 4096 bf16 cuBLAS matmul, as in a
decode step) is replayed without PDL and with the four placements of the grid-dependency instructions: 1 wait
only, 2 wait then launch_dependents (what ``_pdl.pdl_prologue`` does), 3 launch_dependents then wait, 4 the weights
loaded before the wait. Prints device microseconds per launch and whether each result is bitwise the plain chain's.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_pdl.py``. (Session 11 measured this
chain as a one-off script of the same kernel: ``benchmarks/baselines/decode_kernel_sweeps_h200_session11.log``.)
Writes ``benchmarks/results/bench_pdl.jsonl``.
"""

import torch
import triton
import triton.language as tl
from _bench_util import Recorder
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

D = 4096
LAUNCHES = 200


@triton.jit
def _row_kernel(x_ptr, w_ptr, y_ptr, D, BLOCK: tl.constexpr, MODE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    if MODE == 4:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if MODE == 1:
        gdc_wait()
    if MODE == 2:
        gdc_wait()
        gdc_launch_dependents()
    if MODE == 3:
        gdc_launch_dependents()
        gdc_wait()
    if MODE == 4:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
    if MODE != 4:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / D + 1e-6)
    tl.store(y_ptr + row * D + cols, (x * r * w + 0.001).to(y_ptr.dtype.element_ty), mask=ok)


def chain_us(rows: int, mode: int, gemm_every: int) -> tuple[float, torch.Tensor]:
    """(device us per launch of one graph replay, the chain's output)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bufs = [torch.randn(rows, D, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2)]
    w = (torch.rand(D, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    mat = (torch.randn(D, D, generator=g, device="cuda") / 64).to(torch.bfloat16)
    x0 = bufs[0].clone()

    def body():
        bufs[0].copy_(x0)
        for i in range(LAUNCHES):
            a, b = bufs[i % 2], bufs[(i + 1) % 2]
            if gemm_every and i % gemm_every == gemm_every - 1:
                torch.matmul(a, mat, out=b)
            else:
                _row_kernel[(rows,)](a, w, b, D, BLOCK=D, MODE=mode, num_warps=4, launch_pdl=mode != 0)
        return bufs[LAUNCHES % 2]

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    graph.replay()
    torch.cuda.synchronize()
    result = out.clone()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / 20 / LAUNCHES)
    return best, result


def main() -> None:
    rec = Recorder("bench_pdl")
    for rows in (1, 8, 256):
        for gemm_every in (0, 4):
            base_us, base = chain_us(rows, 0, gemm_every)
            row = {"rows": rows, "gemm_every": gemm_every, "no_pdl_us": base_us}
            for mode in (1, 2, 3, 4):
                us, out = chain_us(rows, mode, gemm_every)
                row[f"mode{mode}_us"] = us
                row[f"mode{mode}_bitwise"] = bool(torch.equal(out, base))
            rec.add(case="pdl_chain", **row)


if __name__ == "__main__":
    main()
