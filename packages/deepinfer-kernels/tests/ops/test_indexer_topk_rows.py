"""indexer_topk's ``row_map``: the attention row table of a decode step ([window rows | pool rows of the picks]) made
by the top-k itself. The reference (the composition of the picks and ``paged_rows``) against a Python loop over the
contract; the Triton kernels against that composition, bitwise (torch.equal), on fresh random inputs: with and
without a prefix, offsets, rows with fewer selectable entries than k (-1 padding), picks past the table's width (-1),
several requests with their own tables and several query rows each, block ids whose rows pass 2^32. Under Triton's
interpreter on CPU: the register kernel (with and without its tail part), the split and the streamed kernels, and the
grid kernel in one-piece rows (the interpreter runs programs one after another, so a row of several pieces would wait
at its first barrier forever); on CUDA at V4's decode shapes (1 and 8 rows of 1024 / 8448 entries, k = 512, a
128-row window prefix, 64 rows a block): the register and the grid kernel as the op picks them, every other kernel
forced, and a CUDA graph replayed with new data. And the argument checks."""

import pytest
import torch
from deepinfer_kernels import indexer_topk
from deepinfer_kernels.ops.cache_rows.reference import paged_rows_ref
from deepinfer_kernels.ops.indexer.reference import indexer_topk_ref
from deepinfer_kernels.ops.topk_select.reference import topk_select_ref


def _inputs(b, s, n, width, r, n_pre, seed, device="cpu", big=False):
    """(scores, visible, mask, tables, prefix): scores rounded to bf16 (ties at every magnitude), some -inf and NaN;
    visible lengths from 0 to past N, one row of all N and one of 3 (fewer selectable entries than k); a candidate
    mask; block tables of distinct ids, ``width`` blocks of ``r`` rows (picks past width * r have no row), from 2^27
    on with ``big`` (rows past 2^32); a prefix [b, n_pre] of row ids and -1s (None for n_pre None)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, s, n, generator=g).to(torch.bfloat16).float()
    scores[torch.rand(b, s, n, generator=g) < 0.05] = float("-inf")
    scores[torch.rand(b, s, n, generator=g) < 0.02] = float("nan")
    visible = torch.randint(0, n + 5, (b, s), generator=g)
    if visible.numel() > 1:
        visible.view(-1)[0], visible.view(-1)[-1] = n, 3
    mask = torch.rand(b, s, n, generator=g) < 0.8
    tables = torch.randperm(3 * b * width + 5, generator=g)[: b * width].view(b, width) + ((1 << 27) if big else 0)
    prefix = None if n_pre is None else torch.randint(-1, 1 << 20, (b, n_pre), generator=g)
    prefix = prefix if prefix is None or not big else torch.where(prefix >= 0, prefix + (1 << 33), -1)
    return [t if t is None else t.to(device) for t in (scores, visible, mask, tables, prefix)]


def _picks(scores, visible, k, mask):
    """The picks under the (score desc, index asc) tie rule every Triton kernel follows: ``topk_select``'s
    reference on the flattened query rows, [B, S, min(k, N)]."""
    b, s, n = scores.shape
    flat_mask = None if mask is None else mask.reshape(b * s, n)
    return topk_select_ref(scores.reshape(b * s, n), k, visible.reshape(-1), flat_mask).view(b, s, -1)


def _composed(ids, tables, r, offset, prefix):
    """The definition of the mapped result: ``paged_rows``' reference on each query row's picks."""
    rows = [paged_rows_ref(ids[:, i], tables, r, offset, prefix=prefix) for i in range(ids.shape[1])]
    return torch.stack(rows, 1)


def _loop(ids, tables, r, offset, prefix):
    """The contract in Python ints: the prefix, then each pick's pool row (-1: no pick, or past the table)."""
    out = []
    for b, request in enumerate(ids.tolist()):
        table, pre = tables[b].tolist(), [] if prefix is None else prefix[b].tolist()
        out.append([pre + [table[e // r] * r + e % r + offset if 0 <= e < len(table) * r else -1 for e in q]
                    for q in request])  # fmt: skip
    width = ids.shape[2] + (0 if prefix is None else prefix.shape[1])
    return torch.tensor(out, dtype=torch.int64).view(*ids.shape[:2], width)


@pytest.mark.parametrize(
    "b,s,n,k,width,r,offset,n_pre",
    [
        (3, 2, 60, 8, 3, 16, 0, 5),  # picks past the table (3 * 16 < 60), a prefix, several queries a request
        (4, 1, 40, 64, 20, 2, 777, None),  # k > N, no prefix, an offset
        (2, 3, 50, 10, 0, 4, 1, 2),  # an empty table: every pick is -1
        (2, 1, 30, 0, 4, 8, 5, 3),  # k = 0: the prefix alone
        (1, 0, 30, 4, 4, 8, 5, 3),  # no query rows
        (3, 1, 33, 5, 5, 7, 9, 0),  # a prefix of width 0
    ],
)
def test_reference_is_the_composition(b, s, n, k, width, r, offset, n_pre):
    for seed in range(2):
        scores, visible, mask, tables, prefix = _inputs(b, s, n, width, r, n_pre, seed)
        for m in (None, mask):
            ids = indexer_topk(scores, visible, k, m)  # the CPU op: the reference
            got = indexer_topk(scores, visible, k, m, row_map=(tables, r, offset, prefix))
            assert got.shape == (b, s, (n_pre or 0) + min(k, n)) and got.dtype == torch.int64
            assert torch.equal(got, _loop(ids, tables, r, offset, prefix)), (seed, m is not None)
            assert torch.equal(indexer_topk_ref(scores, visible, k, m, (tables, r, offset, prefix)), got)


def test_row_map_argument_errors():
    scores, visible, _, tables, prefix = _inputs(3, 1, 40, 4, 8, 6, 0)
    good = (tables, 8, 0, prefix)
    assert indexer_topk(scores, visible, 4, row_map=good).shape == (3, 1, 10)
    assert indexer_topk(scores, visible, 4, row_map=list(good)).shape == (3, 1, 10)
    bad = {
        "row_map must be": [(tables, 8, 0), "rows"],
        "tables must be int64": [(tables.int(), 8, 0, prefix), (tables[0], 8, 0, prefix), (None, 8, 0, prefix)],
        "tables .* must be \\[B=3": [(tables[:2], 8, 0, prefix)],
        "rows_per_block": [(tables, 0, 0, prefix), (tables, True, 0, prefix), (tables, 8.0, 0, prefix)],
        "offset": [(tables, 8, -1, prefix), (tables, 8, None, prefix)],
        "prefix must be": [(tables, 8, 0, prefix.int()), (tables, 8, 0, prefix[:2]), (tables, 8, 0, prefix[0]),
                           (tables, 8, 0, [1, 2])],
    }  # fmt: skip
    for match, maps in bad.items():
        for row_map in maps:
            with pytest.raises(ValueError, match=match):
                indexer_topk(scores, visible, 4, row_map=row_map)


triton = pytest.importorskip("triton")
from deepinfer_kernels.ops._triton_launch import counter_block, sm_count, zeroed_scratch  # noqa: E402
from deepinfer_kernels.ops.cache_rows.triton import paged_rows_triton  # noqa: E402
from deepinfer_kernels.ops.indexer.triton import indexer_topk_triton  # noqa: E402
from deepinfer_kernels.ops.topk_select import triton as backend  # noqa: E402
from deepinfer_kernels.ops.topk_select.triton import grid_plan, register_parts, topk_select_triton  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402


def _fused(scores, visible, k, mask, row_map, **kernel):
    """``indexer_topk_triton`` with ``topk_select_triton``'s kernel choices (``kernel``) exposed."""
    b, s, n = scores.shape
    flat_mask = None if mask is None else mask.reshape(b * s, n)
    out = topk_select_triton(scores.reshape(b * s, n), k, visible.reshape(-1), flat_mask, row_map=row_map, **kernel)
    return out.view(b, s, out.shape[1])


def _check(b, s, n, k, width, r, offset, n_pre, seed, device="cpu", big=False, twice=False, **kernel):
    """The fused rows equal the composition bitwise, with and without a candidate mask; the unfused picks are the
    tie rule's (so the composition is the one the Triton backend makes, launch after launch)."""
    scores, visible, mask, tables, prefix = _inputs(b, s, n, width, r, n_pre, seed, device, big)
    row_map = (tables, r, offset, prefix)
    what = f"b={b} s={s} n={n} k={k} width={width} r={r} offset={offset} prefix={n_pre} {kernel}"
    for m in (None, mask):
        ids = _picks(scores, visible, k, m)
        assert torch.equal(_fused(scores, visible, k, m, None, **kernel), ids), what
        want = _composed(ids, tables, r, offset, prefix)
        for _ in range(2 if twice else 1):  # twice: the grid / split kernels left their workspace as found
            got = _fused(scores, visible, k, m, row_map, **kernel)
            assert torch.equal(got, want), f"{what} mask={m is not None}: {(got != want).sum()} slots differ"
        if not kernel:  # the backend's entry point (the block kernel here)
            assert torch.equal(indexer_topk_triton(scores, visible, k, m, row_map), want), what
    if device == "cpu":
        assert torch.equal(want, _loop(ids, tables, r, offset, prefix)), what
    return want


def _interp_block():
    assert register_parts(600)[1] > 0 and register_parts(250)[1] == 0  # 600 entries: a power of two and a tail
    _check(3, 2, 250, 40, 3, 64, 33408, 7, seed=1)  # picks past the table (3 * 64 < 250), several queries a request
    _check(4, 1, 600, 64, 10, 64, 0, None, seed=2)  # the tail part; no prefix, no offset
    _check(4, 1, 200, 512, 3, 64, (1 << 33) + 5, 130, seed=3, big=True)  # k > N; rows past 2^32; 130 prefix columns
    _check(2, 1, 100, 16, 3, 16, (3 << 30) + 7, 4, seed=13, big=True)  # an offset past 2^31 (an unsigned 32-bit arg)
    _check(2, 1, 100, 16, 0, 4, 3, 4, seed=4)  # an empty table
    _check(3, 1, 100, 16, 7, 16, 3, 0, seed=5)  # a prefix of width 0
    _check(2, 2, 100, 0, 7, 16, 3, 4, seed=6)  # k = 0: the prefix alone


def _interp_split_and_stream():
    split = dict(block_row_max=0, chunk=128)  # 1000 entries: 8 pieces of 128, 8 x 40 candidates
    assert backend.split_config(1000, 40, 128) is not None
    _check(3, 2, 1000, 40, 14, 64, 33408, 9, seed=7, twice=True, **split)
    _check(2, 1, 1000, 40, 20, 64, (3 << 30) + 7, None, seed=8, big=True, **split)
    stream = dict(block_row_max=0, chunk=0)
    _check(3, 2, 3000, 100, 40, 64, 33408, 9, seed=9, **stream)
    _check(2, 1, 2500, 3000, 100, 32, 12, 150, seed=10, big=True, **stream)  # k > N


def _interp_grid_one_piece():
    """The grid kernel in rows of one piece (its barriers wait for no other program), on rows of three requests:
    ``grid_plan`` refuses the interpreter and a CPU's single 'SM', so both are stood in for here."""
    saved = backend.interpreting, backend.sm_count
    backend.interpreting, backend.sm_count = (lambda: False), (lambda device: 1 << 10)
    try:
        grid = dict(grid_min=0, grid_chunk=512)
        assert grid_plan(300, 6, backend.sm_count("cpu"), 512) == (512, 1)
        _check(3, 2, 300, 40, 4, 64, 33408, 7, seed=11, twice=True, **grid)
        _check(3, 1, 500, 600, 6, 64, (1 << 33) + 5, 130, seed=12, big=True, **grid)  # k > N
    finally:
        backend.interpreting, backend.sm_count = saved
    assert not zeroed_scratch(torch.device("cpu")).any() and not counter_block(torch.device("cpu")).any()


INTERP_CASES = {
    "block": ("_interp_block", ()),
    "split-and-stream": ("_interp_split_and_stream", ()),
    "grid-one-piece": ("_interp_grid_one_piece", ()),
}

test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # every case in one TRITON_INTERPRET=1 child process


# ---- CUDA, V4's decode shapes -----------------------------------------------------------------------------------


def _v4_decode_inputs(rows: int, n: int, seed: int):
    """A V4 decode step's index lane: scores of ``rows`` requests over n = W * 64 entries (blocks of 256 tokens at
    ratio 4), ReLU-like and bf16-rounded (zeros and other exact ties); visible lengths up to n (with several
    requests, the last one's 100: fewer than k); tables of distinct block ids of a 50K-block pool (the first
    request's past 2^26: rows past 2^32); the window's 128 row ids of each request in a ring table of 128 + 8 rows a
    slot (-1 before the request's start)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = (torch.relu(torch.randn(rows, 1, n, generator=g, device="cuda")) * 3).to(torch.bfloat16).float()
    visible = torch.randint(n // 2, n + 1, (rows, 1), generator=g, device="cuda")
    if rows > 1:
        visible[-1, 0] = 100
    width = n // 64
    tables = torch.randperm(50000, generator=g, device="cuda")[: rows * width].view(rows, width)
    tables[0] += 1 << 26
    pos = torch.randint(0, 4 * n, (rows,), generator=g, device="cuda")
    pos[-1] = 50  # a short request: most of its window is before position 0
    slots = torch.randperm(256, generator=g, device="cuda")[:rows]
    q = pos[:, None] - 127 + torch.arange(128, device="cuda")
    prefix = torch.where(q >= 0, slots[:, None] * 136 + q.clamp(min=0) % 136, -1)
    return scores, visible, tables, prefix


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("n", [1024, 8448])
def test_gpu_row_map_v4_decode_shapes(rows, n):
    """The op as a decode step calls it (the register kernel at 1024 entries, the grid kernel at 8448), and every
    kernel forced: bitwise the composition (the picks, then ``paged_rows``), also as the Triton ops compose it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    scores, visible, tables, prefix = _v4_decode_inputs(rows, n, seed=rows + n)
    offset = 256 * 136  # the window ring table's rows: the pool is the row table's second segment
    row_map = (tables, 64, offset, prefix)
    ids = _picks(scores, visible, 512, None)
    want = _composed(ids, tables, 64, offset, prefix)
    assert want.shape == (rows, 1, 128 + 512) and (rows == 1 or (want[-1, 0, 128 + 100 :] == -1).all())
    got = indexer_topk(scores, visible, 512, row_map=row_map)  # the op: the Triton backend
    assert torch.equal(got, want), f"{(got != want).sum()} slots differ"
    unfused = indexer_topk(scores, visible, 512)
    assert torch.equal(unfused, ids)
    assert torch.equal(paged_rows_triton(unfused[:, 0], tables, 64, offset, prefix=prefix), want[:, 0])
    sms = sm_count(scores.device)
    assert n < backend.GRID_MIN or grid_plan(n, rows, sms) is not None, "8448 entries: the grid kernel"
    grid_chunk, split_chunk = (512, 512) if n == 1024 else (1024, 4096)
    assert grid_plan(n, rows, sms, grid_chunk) and backend.split_config(n, 512, split_chunk)
    forced = {
        "grid": dict(grid_min=0, grid_chunk=grid_chunk),
        "register": dict(grid_chunk=0),
        "split": dict(grid_chunk=0, block_row_max=0, chunk=split_chunk, split_programs=1 << 20),
        "stream": dict(grid_chunk=0, block_row_max=0, chunk=0),
    }
    for name, kernel in forced.items():
        for _ in range(2):  # twice: the grid / split kernels leave their workspace as found
            got = _fused(scores, visible, 512, None, row_map, **kernel)
            assert torch.equal(got, want), f"{name}: {(got != want).sum()} slots differ"
    assert not zeroed_scratch(scores.device).any() and not counter_block(scores.device).any(), "left as found"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_row_map_graph_replay(rows):
    """The fused op (the grid kernel: 8448 entries) captured in a CUDA graph and replayed after copying a later
    step's scores, lengths, tables and window rows in: each replay's row table is that step's composition."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    static = _v4_decode_inputs(rows, 8448, seed=0)

    def step():
        scores, visible, tables, prefix = static
        return indexer_topk(scores, visible, 512, row_map=(tables, 64, 999, prefix))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        new = _v4_decode_inputs(rows, 8448, seed)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        scores, visible, tables, prefix = new
        want = _composed(_picks(scores, visible, 512, None), tables, 64, 999, prefix)
        assert torch.equal(out, want), f"replay {seed}: {(out != want).sum()} slots differ"
