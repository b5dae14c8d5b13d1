"""ring_rows / paged_rows / scatter_rows / ring_scatter / gather_rows: the references vs a straightforward Python
loop over the contract (fresh random inputs: -1 ids, positions before 0, rings that hold nothing yet, every > 1,
offsets, ids past the table, empty shapes), the argument checks, and the Triton kernels vs the references (integers:
exactly equal) under Triton's interpreter on CPU (one child process) and on CUDA at a decode step's sizes, also
captured in a CUDA graph and replayed with new data. The row writes: the kernels against the references bitwise
(copies and a round-to-nearest cast) at decode shapes on CUDA, and at small shapes in the interpreter (whose casts
truncate). The row gather (token embeddings in every residual stream): bitwise a loop and the reference, on CPU, in
the interpreter (fp32 / fp16, ragged columns, repeated ids) and on CUDA at the embedding's shape (bf16, 1-256 rows)."""

import importlib.util

import pytest
import torch
from deepinfer_kernels import gather_rows, paged_rows, ring_rows, ring_scatter, scatter_rows
from deepinfer_kernels.ops.cache_rows.reference import (
    gather_rows_ref,
    paged_rows_ref,
    ring_rows_ref,
    ring_scatter_ref,
    scatter_rows_ref,
)
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close


def _ring_loop(pos, slots, first, capacity: int, n: int, every: int) -> torch.Tensor:
    """The contract, one entry at a time in Python ints."""
    out = []
    for p, s, f in zip(pos.tolist(), slots.tolist(), first.tolist()):
        row = []
        for j in range(n):
            q = p - n + 1 + j
            held = q >= f and (every == 1 or (p + 1) % every == 0)
            row.append(s * capacity + max(q, 0) % capacity if held else -1)
        out.append(row)
    return torch.tensor(out, dtype=torch.int64).view(len(out), n)


def _paged_loop(ids, tables, r: int, offset: int) -> torch.Tensor:
    out = []
    for row_ids, table in zip(ids.tolist(), tables.tolist()):
        out.append([table[e // r] * r + e % r + offset if 0 <= e and e // r < len(table) else -1 for e in row_ids])
    return torch.tensor(out, dtype=torch.int64).view(ids.shape)


def _ring_inputs(rows: int, capacity: int, n: int, seed: int, device="cpu"):
    """Positions from 0 (q < 0 for most entries) to a few rings deep, slots anywhere in a pool of 2 * rows + 3,
    first held positions below, inside and above each request's window (and above p: nothing held)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 3 * (capacity + n) + 2, (rows,), generator=g)
    if rows:
        pos[0] = 0
    slots = torch.randint(0, 2 * rows + 3, (rows,), generator=g)
    first = pos - torch.randint(-2, n + 3, (rows,), generator=g)
    if rows > 1:
        first[1] = 0
    return pos.to(device), slots.to(device), first.to(device)


def _paged_inputs(rows: int, k: int, width: int, r: int, seed: int, device="cpu"):
    """Block tables of distinct block ids and entry numbers from -2 to two blocks past the table, some -1."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(rows * width + 5, generator=g)[: rows * width].view(rows, width)
    ids = torch.randint(-2, (width + 2) * r, (rows, k), generator=g)
    ids[torch.rand(rows, k, generator=g) < 0.2] = -1
    return ids.to(device), tables.to(device)


RING_CASES = [  # rows, capacity, n, every
    (5, 9, 4, 1),  # a window
    (6, 12, 8, 4),  # CSA overlap: 2r rows every r
    (7, 4, 2, 2),  # V4.1 ratio 2
    (4, 1, 1, 1),
    (3, 5, 8, 1),  # n > capacity: entries alias (the op does not refuse)
    (9, 17, 16, 16),
    (0, 4, 3, 1),  # no rows
    (4, 4, 0, 2),  # no entries
]
PAGED_CASES = [  # rows, K, width, rows_per_block, offset
    (5, 7, 3, 4, 0),
    (6, 16, 5, 2, 37),
    (3, 9, 1, 1, 5),
    (4, 6, 4, 64, 1000),
    (3, 5, 0, 4, 2),  # empty tables: every id is past them
    (0, 6, 3, 4, 0),
    (4, 0, 3, 4, 3),
]


@pytest.mark.parametrize("rows,capacity,n,every", RING_CASES)
def test_ring_rows_reference_matches_the_contract(rows, capacity, n, every):
    for seed in range(3):
        args = (*_ring_inputs(rows, capacity, n, seed), capacity, n, every)
        want = _ring_loop(*args)
        assert_bitwise(ring_rows_ref(*args), want, f"ring rows={rows} n={n} every={every}")
        assert_bitwise(ring_rows(*args), want, "public op on CPU")


def test_ring_rows_edges():
    pos, slots, first = torch.tensor([0, 5, 7, 3]), torch.tensor([2, 0, 1, 3]), torch.tensor([0, 3, 0, 9])
    got = ring_rows(pos, slots, first, 6, 3)
    # p=0: q=-2,-1 below first 0; p=5 from 3; p=7 in slot 1 wraps (q=5,6,7 -> 5,0,1); first 9 > p=3: nothing
    assert got.tolist() == [[-1, -1, 12], [3, 4, 5], [11, 6, 7], [-1, -1, -1]]
    got = ring_rows(pos, slots, torch.full_like(first, -5), 6, 3, every=4)  # only p = 3 and 7 complete a group
    assert got.tolist() == [[-1, -1, -1], [-1, -1, -1], [11, 6, 7], [19, 20, 21]]
    # first below 0: positions before 0 are "held" and read row max(q, 0) (the old ring_ids did the same)
    assert ring_rows(pos[:1], slots[:1], torch.tensor([-9]), 6, 3).tolist() == [[12, 12, 12]]


@pytest.mark.parametrize("rows,k,width,r,offset", PAGED_CASES)
def test_paged_rows_reference_matches_the_contract(rows, k, width, r, offset):
    for seed in range(3):
        ids, tables = _paged_inputs(rows, k, width, r, seed)
        want = _paged_loop(ids, tables, r, offset)
        assert_bitwise(paged_rows_ref(ids, tables, r, offset), want, f"paged rows={rows} K={k} width={width}")
        assert_bitwise(paged_rows(ids, tables, r, offset), want, "public op on CPU")


def test_paged_rows_equals_the_old_gather_plus_offset():
    """What DecodeBatch.pool_rows and its callers computed (ids inside the table): bitwise the same."""
    ids, tables = _paged_inputs(8, 32, 6, 4, 11)
    ids = torch.where(ids < 6 * 4, ids, -1)
    safe = ids.clamp(min=0)
    old = torch.where(ids >= 0, tables.gather(1, safe // 4) * 4 + safe % 4, -1)
    assert_bitwise(paged_rows(ids, tables, 4), old, "offset 0")
    assert_bitwise(paged_rows(ids, tables, 4, offset=77), torch.where(old >= 0, old + 77, -1), "offset 77")


def test_paged_rows_limit_count_and_prefix_are_the_torch_expressions():
    """``limit``, ``ids`` = K and ``prefix``: what a decode step computed with arange, where and cat around the op."""
    for seed, (rows, k, width, r) in enumerate(((5, 12, 3, 4), (3, 7, 2, 2), (4, 0, 3, 4), (1, 9, 0, 4))):
        ids, tables = _paged_inputs(rows, k, width, r, seed)
        g = torch.Generator().manual_seed(seed)
        limit = torch.randint(-1, k + 3, (rows,), generator=g)
        prefix = torch.randint(-1, 50, (rows, 6), generator=g)
        masked = torch.where(ids < limit[:, None], ids, -1)
        want = paged_rows_ref(masked, tables, r, 3)
        assert_bitwise(paged_rows(ids, tables, r, 3, limit=limit), want, f"limit {seed}")
        assert_bitwise(paged_rows(ids, tables, r, 3, limit=limit, prefix=prefix), torch.cat([prefix, want], 1), "cat")
        ar = torch.arange(k)[None].expand(rows, -1)
        visible = torch.where(ar < limit[:, None], ar, -1)  # V4's HCA rows: every visible entry
        got = paged_rows(k, tables, r, 3, limit=limit)
        assert_bitwise(got, paged_rows_ref(visible.contiguous(), tables, r, 3), f"count {seed}")
        assert_bitwise(got, _paged_loop(visible, tables, r, 3), f"count {seed} (loop)")
        assert_bitwise(paged_rows(k, tables, r), paged_rows_ref(ar.contiguous(), tables, r), f"count, no limit {seed}")


def test_paged_rows_past_the_table_is_minus_one():
    tables = torch.tensor([[3, 1], [0, 2]])
    ids = torch.tensor([[0, 3, 4, 7, -1], [5, 8, 100, -2, 1]])
    assert paged_rows(ids, tables, 4, offset=10).tolist() == [[22, 25, 14, 17, -1], [19, -1, -1, -1, 11]]


def test_argument_errors():
    pos = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        ring_rows(pos.int(), pos, pos, 4, 2)
    with pytest.raises(ValueError, match="rows"):
        ring_rows(pos, pos[:2], pos, 4, 2)
    with pytest.raises(ValueError, match="rows"):
        ring_rows(pos[:, None], pos, pos, 4, 2)
    with pytest.raises(ValueError, match="capacity"):
        ring_rows(pos, pos, pos, 0, 2)
    with pytest.raises(ValueError, match="n must"):
        ring_rows(pos, pos, pos, 4, -1)
    with pytest.raises(ValueError, match="every"):
        ring_rows(pos, pos, pos, 4, 2, every=0)
    with pytest.raises(ValueError, match="capacity"):
        ring_rows(pos, pos, pos, 4.0, 2)
    ids, tables = torch.zeros(3, 5, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        paged_rows(ids.int(), tables, 4)
    with pytest.raises(ValueError, match="int64"):
        paged_rows(ids[0], tables, 4)
    with pytest.raises(ValueError, match="same rows"):
        paged_rows(ids, tables[:2], 4)
    with pytest.raises(ValueError, match="rows_per_block"):
        paged_rows(ids, tables, 0)
    with pytest.raises(ValueError, match="offset"):
        paged_rows(ids, tables, 4, offset=-1)
    with pytest.raises(ValueError, match="offset"):
        paged_rows(ids, tables, 4, offset=True)
    with pytest.raises(ValueError, match="entry count"):
        paged_rows(-1, tables, 4)
    with pytest.raises(ValueError, match="limit"):
        paged_rows(ids, tables, 4, limit=ids[:, 0].int())
    with pytest.raises(ValueError, match="prefix"):
        paged_rows(ids, tables, 4, prefix=ids[:2])


# --- Triton ---------------------------------------------------------------------------------------------------


def _check_triton(ring_cases, paged_cases, device, seed):
    from deepinfer_kernels.ops.cache_rows.triton import paged_rows_triton, ring_rows_triton

    for i, (rows, capacity, n, every) in enumerate(ring_cases):
        pos, slots, first = _ring_inputs(rows, capacity, n, seed + i, device)
        want = ring_rows_ref(pos, slots, first, capacity, n, every)
        got = ring_rows_triton(pos, slots, first, capacity, n, every)
        what = f"ring rows={rows} cap={capacity} n={n} every={every}"
        assert_bitwise(got, want, what)
        if rows and device == "cpu":
            assert_bitwise(got, _ring_loop(pos, slots, first, capacity, n, every), what + " (loop)")
        if rows > 1:  # one request alone: the same row
            assert_bitwise(ring_rows_triton(pos[-1:], slots[-1:], first[-1:], capacity, n, every), got[-1:], what)
    for i, (rows, k, width, r, offset) in enumerate(paged_cases):
        ids, tables = _paged_inputs(rows, k, width, r, seed + i, device)
        want = paged_rows_ref(ids, tables, r, offset)
        what = f"paged rows={rows} K={k} width={width} R={r} offset={offset}"
        assert_bitwise(paged_rows_triton(ids, tables, r, offset), want, what)
        if rows > 1:
            assert_bitwise(paged_rows_triton(ids[-1:], tables[-1:], r, offset), want[-1:], what)
        # limit, an entry count instead of ids, and a prefix (a column block may hold both kinds of column)
        g = torch.Generator().manual_seed(seed + i)
        limit = torch.randint(-1, k + 3, (rows,), generator=g).to(device)
        prefix = torch.randint(-1, 1 << 40, (rows, 2 * k + 3), generator=g).to(device)[:, ::2]  # a strided view
        for ids_arg in (ids, k):
            for kw in (dict(limit=limit), dict(prefix=prefix), dict(limit=limit, prefix=prefix)):
                want = paged_rows_ref(ids_arg, tables, r, offset, **kw)
                got = paged_rows_triton(ids_arg, tables, r, offset, **kw)
                assert_bitwise(got, want, f"{what} ids={'K' if isinstance(ids_arg, int) else 'tensor'} {sorted(kw)}")


# --- row writes -----------------------------------------------------------------------------------------------


def _write_inputs(b: int, slots_n: int, r: int, c: int, seed: int, device="cpu", rows_dtype=torch.float32):
    """A ring buffer [S, R, C] bf16, B new rows (distinct slots: one request each), positions up to a few rings deep;
    rows as a strided view (every other column of a wider tensor)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(slots_n, r, c, generator=g).to(torch.bfloat16).to(device)
    slots = torch.randperm(slots_n, generator=g)[:b].to(device)
    pos = torch.randint(0, 5 * r, (b,), generator=g).to(device)
    rows = torch.randn(b, 2 * c, generator=g).to(rows_dtype).to(device)[:, ::2]
    return buf, rows, slots, pos


def test_row_write_references_match_a_loop():
    buf, rows, slots, pos = _write_inputs(5, 9, 6, 7, seed=1)
    want = buf.clone()
    for b in range(5):
        want[slots[b], pos[b] % 6] = rows[b].to(torch.bfloat16)
    got = buf.clone()
    ring_scatter(got, rows, slots, pos)  # CPU: the reference
    assert_bitwise(got, want, "ring_scatter")
    flat = buf.clone().view(-1, 7)
    index = slots * 6 + pos % 6
    scatter_rows(flat, rows, index)
    assert_bitwise(flat.view_as(buf), want, "scatter_rows")


def test_ring_scatter_bias_is_the_sum_written():
    """A compressor's score plus its position bias ape[p % r], written in one call: torch's sum, then the cast."""
    buf, rows, slots, pos = _write_inputs(5, 9, 6, 7, seed=3)
    bias = torch.randn(4, 7, generator=torch.Generator().manual_seed(3))
    bias_index = pos % 4
    want, got = buf.clone(), buf.clone()
    ring_scatter_ref(want, rows + bias[bias_index], slots, pos)
    ring_scatter(got, rows, slots, pos, bias=bias, bias_index=bias_index)
    assert_bitwise(got, want, "ring_scatter with bias")
    with pytest.raises(ValueError, match="together"):
        ring_scatter(got, rows, slots, pos, bias=bias)
    with pytest.raises(ValueError, match="fp32"):
        ring_scatter(got, rows.bfloat16(), slots, pos, bias=bias.bfloat16(), bias_index=bias_index)
    with pytest.raises(ValueError, match="bias must be"):
        ring_scatter(got, rows, slots, pos, bias=bias[:, :5], bias_index=bias_index)
    with pytest.raises(ValueError, match="bias_index must be int64"):
        ring_scatter(got, rows, slots, pos, bias=bias, bias_index=bias_index[:3])


def test_row_write_argument_errors():
    buf, rows, slots, pos = _write_inputs(3, 4, 5, 8, seed=2)
    with pytest.raises(ValueError, match="rows"):
        ring_scatter(buf, rows[:, :4], slots, pos)
    with pytest.raises(ValueError, match="pos must be int64"):
        ring_scatter(buf, rows, slots, pos.int())
    with pytest.raises(ValueError, match="index must be int64 \\[3\\]"):
        scatter_rows(buf.view(-1, 8), rows, slots[:2])
    with pytest.raises(ValueError, match="3-D"):
        ring_scatter(buf.view(-1, 8), rows, slots, pos)


def test_gather_rows_is_a_loop_and_checks_its_arguments():
    g = torch.Generator().manual_seed(3)
    table = torch.randn(50, 12, generator=g).to(torch.bfloat16)
    index = torch.tensor([4, 0, 49, 4], dtype=torch.int64)
    assert_bitwise(gather_rows(table, index), torch.stack([table[i] for i in index.tolist()]), "rows")
    streams = gather_rows(table, index, 3)
    assert streams.shape == (4, 3, 12) and streams.is_contiguous()
    for b, i in enumerate(index.tolist()):
        for j in range(3):
            assert_bitwise(streams[b, j], table[i], f"row {b} copy {j}")
    assert gather_rows(table, index[:0], 2).shape == (0, 2, 12)
    with pytest.raises(ValueError, match="index must be int64"):
        gather_rows(table, index.int())
    with pytest.raises(ValueError, match="unit stride"):
        gather_rows(table.t(), index)
    with pytest.raises(ValueError, match="copies must be an int >= 1"):
        gather_rows(table, index, 0)


def _check_gather(cases, device, seed):
    from deepinfer_kernels.ops.cache_rows.triton import gather_rows_triton

    for i, (n, c, b, copies, dtype) in enumerate(cases):
        g = torch.Generator().manual_seed(seed + i)
        table = torch.randn(n, c, generator=g).to(getattr(torch, dtype)).to(device)
        index = torch.randint(0, n, (b,), generator=g).to(device)
        if b > 1:
            index[1] = index[0]  # a repeated id
        got, want = gather_rows_triton(table, index, copies), gather_rows_ref(table, index, copies)
        assert got.shape == want.shape and got.is_contiguous()
        assert_bitwise(got, want, f"gather_rows N={n} C={c} B={b} copies={copies} {dtype}")
        strided = torch.stack([index, index.flip(0)], dim=1)[:, 0]  # the same ids as a view of stride 2
        assert_bitwise(gather_rows_triton(table, strided, copies), want, f"gather_rows strided index N={n} B={b}")


def _check_writes(cases, device, seed):
    from deepinfer_kernels.ops.cache_rows.triton import ring_scatter_triton, scatter_rows_triton

    for i, (b, slots_n, r, c, dtype) in enumerate(cases):
        dtype = getattr(torch, dtype)
        buf, rows, slots, pos = _write_inputs(b, slots_n, r, c, seed + i, device, dtype)
        want, got = buf.clone(), buf.clone()
        ring_scatter_ref(want, rows, slots, pos)
        ring_scatter_triton(got, rows, slots, pos)
        # with a bias row per request (fp32 rows and bias: the compressors' scores and position biases)
        if dtype == torch.float32 and b:
            bias = torch.randn(5, c, generator=torch.Generator().manual_seed(seed + i)).to(device)
            bias_index = (pos % 5).contiguous()
            want_b, got_b = buf.clone(), buf.clone()
            ring_scatter_ref(want_b, rows, slots, pos, bias, bias_index)
            ring_scatter_triton(got_b, rows, slots, pos, bias, bias_index)
            if device == "cpu":  # the interpreter's cast truncates: within 1 bf16 ulp
                assert_rel_close(got_b.float(), want_b.float(), 2**-7, f"ring_scatter + bias B={b} C={c}")
            else:
                assert_bitwise(got_b, want_b, f"ring_scatter + bias B={b} C={c}")
            want_b, got_b = buf.float(), buf.float()  # an fp32 ring (the compressors' score rings): no cast
            ring_scatter_ref(want_b, rows, slots, pos, bias, bias_index)
            ring_scatter_triton(got_b, rows, slots, pos, bias, bias_index)
            assert_bitwise(got_b, want_b, f"ring_scatter + bias into fp32 B={b} C={c}")
        flat_want, flat_got = buf.clone().view(-1, c), buf.clone().view(-1, c)
        index = slots * r + pos % r
        scatter_rows_ref(flat_want, rows, index)
        scatter_rows_triton(flat_got, rows, index)
        for what, a, e in (("ring_scatter", got, want), ("scatter_rows", flat_got, flat_want)):
            what = f"{what} B={b} R={r} C={c} {dtype}"
            if device == "cpu" and dtype != buf.dtype:  # the interpreter's casts truncate: within 1 bf16 ulp
                assert_rel_close(a.float(), e.float(), 2**-7, what)
            else:
                assert_bitwise(a, e, what)


def _interp_cases(which: str):
    if which == "ring":
        _check_triton(RING_CASES + [(3, 40, 1500, 1), (2, 130, 128, 128)], [], "cpu", 1)
    else:
        _check_triton([], PAGED_CASES + [(3, 1100, 8, 2, 9)], "cpu", 2)


def _interp_strided_inputs():
    """Views with strides (the plan's fields are slices of one tensor; ids may be a transposed view)."""
    from deepinfer_kernels.ops.cache_rows.triton import paged_rows_triton, ring_rows_triton

    data = torch.arange(40, dtype=torch.int64) * 3
    pos, slots, first = data[0:20:2], data[1:21:2] % 7, data[2:22:2] - 5
    assert_bitwise(ring_rows_triton(pos, slots, first, 8, 6, 3), ring_rows_ref(pos, slots, first, 8, 6, 3), "ring")
    ids, tables = _paged_inputs(9, 4, 3, 2, 5)
    ids, tables = ids.t().contiguous().t(), tables.t().contiguous().t()
    assert_bitwise(paged_rows_triton(ids, tables, 2, 4), paged_rows_ref(ids, tables, 2, 4), "paged")


INTERP_CASES = {
    "ring-rows": ("_interp_cases", ("ring",)),
    "paged-rows": ("_interp_cases", ("paged",)),
    "strided-inputs": ("_interp_strided_inputs", ()),
    "row-writes": (
        "_check_writes",
        ([(3, 5, 4, 40, "float32"), (1, 2, 3, 1100, "bfloat16"), (0, 2, 3, 8, "float32")], "cpu", 4),
    ),
    # ragged columns (1100: two blocks), one copy or four, none (a [B, C] result), no rows
    "row-gather": (
        "_check_gather",
        (
            [
                (30, 1100, 5, 4, "float32"),
                (7, 40, 3, None, "float16"),
                (9, 16, 1, 1, "float32"),
                (4, 8, 0, 2, "float32"),
            ],
            "cpu",
            6,
        ),
    ),  # fmt: skip
}

if importlib.util.find_spec("triton") is not None:
    from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test

    test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


GPU_RING = [  # a decode step's rings: windows (W = 128, + B rows), CSA 2r every r, HCA r every r, V4.1 ratio 2
    (rows, capacity, n, every)
    for rows in (1, 3, 64, 256)
    for capacity, n, every in ((130, 128, 1), (200, 128, 1), (12, 8, 4), (200, 128, 128), (4, 2, 2), (200, 640, 1))
]
GPU_PAGED = [  # top-512 entries through tables up to 128 blocks wide; rows per block: 64 (CSA), 2 (HCA), 128
    (rows, 512, width, r, offset)
    for rows in (1, 3, 64, 256)
    for width, r, offset in ((8, 64, 0), (128, 2, 33408), (128, 128, 128), (0, 4, 5))
]


@pytest.mark.gpu
def test_gpu_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    _check_triton(GPU_RING, GPU_PAGED, "cuda", 3)
    # row writes at decode sizes: windows (512 wide, bf16), compressor rings (fp32 rows of 1024 / 256), entries
    _check_writes(
        [
            (b, 2 * b + 1, r, c, dt)
            for b in (1, 64, 256)
            for r, c, dt in ((130, 512, "bfloat16"), (8, 1024, "float32"), (256, 256, "float32"))
        ],
        "cuda",
        5,
    )
    # token embeddings: V4 / V4.1 hidden sizes, hc_mult = 4 streams, a decode step's rows and a DSpark chain's
    _check_gather([(129280, d, b, 4, "bfloat16") for d in (4096, 5120) for b in (1, 8, 256)], "cuda", 7)
    _check_gather([(129280, 4096, 17, None, "bfloat16")], "cuda", 8)
    from deepinfer_kernels import registry
    from deepinfer_kernels.ops.cache_rows.triton import gather_rows_triton, paged_rows_triton, ring_rows_triton

    if not registry.force_reference():  # what a step on CUDA runs
        assert registry.resolve("ring_rows", "cuda") is ring_rows_triton
        assert registry.resolve("paged_rows", "cuda") is paged_rows_triton
        assert registry.resolve("gather_rows", "cuda") is gather_rows_triton


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 256])
def test_gpu_cuda_graph_replay_with_new_data(rows):
    """Both ops captured in one graph over static inputs, replayed after copying in a later step's data."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    static = [t.clone() for t in _ring_inputs(rows, 200, 128, 7, "cuda")]
    static += [t.clone() for t in _paged_inputs(rows, 512, 128, 2, 7, "cuda")]

    def step():
        pos, slots, first, ids, tables = static
        return ring_rows(pos, slots, first, 200, 128, 4), paged_rows(ids, tables, 2, offset=rows * 200)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ring_out, paged_out = step()
    for seed in (8, 9):
        new = [*_ring_inputs(rows, 200, 128, seed, "cuda"), *_paged_inputs(rows, 512, 128, 2, seed, "cuda")]
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        pos, slots, first, ids, tables = new
        assert_bitwise(ring_out, ring_rows_ref(pos, slots, first, 200, 128, 4), f"ring replay seed {seed}")
        assert_bitwise(paged_out, paged_rows_ref(ids, tables, 2, rows * 200), f"paged replay seed {seed}")
