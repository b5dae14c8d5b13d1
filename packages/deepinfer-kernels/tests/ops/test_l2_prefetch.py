"""l2_prefetch: a hint, so its contract is what it must not do (change a value, fail on an odd tensor, break a CUDA
graph) and which bytes it asks for. The byte ranges the Triton kernel computes are checked against the plan
(prefix, or the leading share of every row) under Triton's interpreter on the CPU (the kernel's record mode:
the interpreter has no inline asm); on CUDA the prefetches run on V4-Flash weights, eagerly and from a graph."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.l2_prefetch import l2_prefetch  # noqa: E402
from deepinfer_kernels.ops.l2_prefetch.reference import l2_prefetch_ref  # noqa: E402
from deepinfer_kernels.ops.l2_prefetch.triton import CHUNK, prefetch_items, prefetch_ranges  # noqa: E402
from deepinfer_kernels.registry import resolve  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402


def expected_bytes(base: int, nbytes: int, max_bytes: int, period: int) -> set[int]:
    """Byte offsets the plan asks for: the first max_bytes, or the same leading share of every period-byte span,
    each span's part rounded up (never past the span) and every range's ends rounded inwards to 16-byte addresses."""
    share = min(max_bytes, nbytes)
    if period == 0 or period >= nbytes:
        spans = [(0, share)]
    else:
        take = min(period, -(-share * period // nbytes))
        spans = [(s, min(s + take, nbytes)) for s in range(0, nbytes, period)]
    out: set[int] = set()
    for lo, hi in spans:
        for p in range(lo, hi, CHUNK):
            a = -(-(base + p) // 16) * 16 - base
            b = (base + min(p + CHUNK, hi)) // 16 * 16 - base
            out.update(range(a, max(a, b)))
    return out


def _covered(rec: torch.Tensor) -> set[int]:
    out: set[int] = set()
    for off, size in rec.tolist():
        assert size >= 0 and size % 16 == 0
        out.update(range(off, off + size))
    return out


def _interp_ranges(rows: int, cols: int, offset: int, max_bytes: int, by_row: bool) -> None:
    flat = torch.zeros(offset + rows * cols * 2, dtype=torch.uint8)
    t = flat[offset:].view(torch.bfloat16).view(rows, cols)
    nbytes = rows * cols * 2
    period = cols * 2 if by_row else 0
    rec = prefetch_ranges(t, max_bytes, period)
    assert rec.shape[0] == prefetch_items(nbytes, max_bytes, period, CHUNK)[3]
    got = _covered(rec)
    assert got == expected_bytes(t.data_ptr(), nbytes, max_bytes, period), (rows, cols, offset, max_bytes, by_row)
    assert all(0 <= b < nbytes for b in got)
    if t.data_ptr() % 16 == 0 and max_bytes >= nbytes:  # the whole (aligned) tensor, in either layout
        assert got == set(range(nbytes // 16 * 16))


INTERP_CASES = {
    "prefix_all": ("_interp_ranges", (64, 1024, 0, 1 << 30, False)),
    "prefix_part": ("_interp_ranges", (64, 1024, 0, 40_000, False)),
    "rows_quarter": ("_interp_ranges", (48, 4096, 0, 48 * 4096 * 2 // 4, True)),
    "rows_wide_pieces": ("_interp_ranges", (5, 24576, 0, 5 * 24576, True)),  # a row of 48 KB: 3 pieces each
    "rows_unaligned": ("_interp_ranges", (33, 100, 6, 2000, True)),
    "prefix_unaligned": ("_interp_ranges", (7, 333, 2, 3000, False)),
    "rows_ragged_tail": ("_interp_ranges", (7, 333, 0, 1000, True)),  # period 666: not a multiple of 16
}

test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


def test_items_plan():
    assert prefetch_items(100, 0, 0, 16) == (100, 0, 0, 0)
    assert prefetch_items(100, 50, 0, 16) == (100, 50, 4, 4)
    assert prefetch_items(1000, 250, 100, 64) == (100, 25, 1, 10)  # a quarter of every 100-byte span
    assert prefetch_items(1000, 5000, 100, 64) == (100, 100, 2, 20)
    assert prefetch_items(1000, 10, 5000, 64) == (1000, 10, 1, 1)  # a period past the tensor: one span


def test_reference_and_errors():
    w = torch.randn(8, 16)
    before = w.clone()
    assert l2_prefetch(w, 1 << 20) is None and torch.equal(w, before)
    assert resolve("l2_prefetch", "cpu") is l2_prefetch_ref
    with pytest.raises(ValueError, match="max_bytes"):
        l2_prefetch(w, -1)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(w.t(), 16)


@pytest.mark.gpu
@pytest.mark.parametrize("by_row", [False, True])
def test_gpu_weights_unchanged_eager_and_graph(by_row):
    """V4-Flash decode weights (wo_a 8192 x 4096, wq_b 32768 x 1024 bf16, an odd fp32 tensor at an unaligned
    offset): prefetched eagerly and from a captured graph on a side stream beside a GEMV that reads the same
    weight; values and the GEMV's result unchanged."""
    g = torch.Generator(device="cuda").manual_seed(5)
    w1 = torch.randn(8192, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(32768, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    w3 = torch.randn(1 + 7 * 333, generator=g, device="cuda")[1:].view(7, 333)
    x = torch.randn(1, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    copies = [w.clone() for w in (w1, w2, w3)]
    want = x @ w1.t()
    side = torch.cuda.Stream()

    def step() -> torch.Tensor:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for w in (w1, w2, w3):
                l2_prefetch(w, 24 << 20, w.shape[-1] * w.element_size() if by_row else 0)
        y = x @ w1.t()
        torch.cuda.current_stream().wait_stream(side)
        return y

    assert torch.equal(step(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    for w, c in zip((w1, w2, w3), copies):
        assert torch.equal(w, c)
