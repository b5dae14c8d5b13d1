"""topk_select: the reference's contract (against indexer_topk's reference), and the Triton radix select under the
interpreter on CPU at small shapes and on CUDA at indexer shapes (k = 512 of N = 1K..128K), all three kernels (rows
held in registers up to ``BLOCK_ROW_MAX`` entries; past it, split into pieces whose candidates the row's last piece
selects from, or streamed: ``block_row_max=0`` skips the register kernel, ``chunk`` sizes the pieces, 0 forces the
stream; ``split_programs`` caps rows x pieces). Selection is exact, so every comparison is bitwise equality of the
index rows, including ties (lower index wins, also across pieces), -inf / NaN / masked entries and rows with fewer
than k entries, and a selectable-entry mask read by the kernels (the same rows as -inf written into the scores)."""

import pytest
import torch
from deepinfer_kernels.ops.indexer.reference import indexer_topk_ref  # noqa: E402
from deepinfer_kernels.ops.topk_select import topk_select  # noqa: E402
from deepinfer_kernels.ops.topk_select.reference import topk_select_ref  # noqa: E402


def _hard_rows(n: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Rows exercising every rule: distinct floats, heavy ties, ties straddling the k boundary,
    signed zeros, NaN / -inf, all -inf, short lengths (0, < k), negative-only scores, huge / tiny
    magnitudes (all radix digits matter)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(12, n, generator=g, device=device)
    x[1] = torch.randint(-4, 4, (n,), generator=g, device=device).float()  # few distinct values
    x[2] = 1.0
    x[2, n // 2 :] = 2.0  # the boundary falls inside a run of ties
    x[3] = 0.0
    x[3, ::2] = -0.0
    x[3, ::5] = -1.0
    x[4, ::3] = float("nan")
    x[4, 1::3] = float("-inf")
    x[5] = float("-inf")
    x[6] = -x[6].abs() - 1.0
    x[7] = x[7] * 1e30
    x[7, ::4] = x[7, ::4] * 1e-60
    x[8, ::7] = float("inf")
    x[9] = 1.0 + torch.randint(0, 3, (n,), generator=g, device=device).float() * 2**-20  # last bits decide
    lengths = torch.full((12,), n, dtype=torch.int64, device=device)
    lengths[0], lengths[1], lengths[10], lengths[11] = n // 3, 7, 0, n + 100  # past the end = all
    return x, lengths


def test_reference_matches_indexer_topk_and_breaks_ties_by_index():
    x, lengths = _hard_rows(300, 0)
    got = topk_select_ref(x, 40, lengths)
    x[9] = torch.randn(300)  # indexer_topk leaves ties unspecified: compare its sets on tie-free rows
    want = indexer_topk_ref(x[None], lengths[None], 40)[0]
    for r in (0, 4, 5, 6, 7, 10, 11):
        assert torch.equal(got[r], want[r]), f"row {r}"
    assert got[2].tolist() == list(range(150, 190)), "ties at the boundary: lowest indices of the 2.0 run"
    assert got[1][:7].tolist() == sorted(got[1][:7].tolist()) and (got[1][7:] == -1).all()
    assert (got[5] == -1).all() and (got[10] == -1).all()
    zeros = topk_select_ref(x[3:4], 300)[0]
    assert (zeros >= 0).sum() == 300, "-0.0 and +0.0 are selectable"
    assert topk_select(x, 0).shape == (12, 0) and topk_select(x, 1000, lengths).shape == (12, 300)


def test_mask_is_minus_infinity_written_into_the_scores():
    x, lengths = _hard_rows(300, 5)
    mask = torch.rand(12, 300, generator=torch.Generator().manual_seed(5)) < 0.7
    want = topk_select_ref(torch.where(mask, x, float("-inf")), 40, lengths)
    assert torch.equal(topk_select(x, 40, lengths, mask), want)
    assert torch.equal(topk_select_ref(x, 40, lengths, mask), want)
    with pytest.raises(ValueError, match="mask must be bool"):
        topk_select(x, 40, lengths, mask.int())
    with pytest.raises(ValueError, match="mask must be bool"):
        topk_select(x, 40, lengths, mask[:, :10])


triton = pytest.importorskip("triton")
from deepinfer_kernels.ops._triton_launch import counter_block, sm_count, zeroed_scratch  # noqa: E402
from deepinfer_kernels.ops.topk_select.triton import (  # noqa: E402
    GRID_MIN,
    grid_plan,
    register_parts,
    split_config,
    topk_select_triton,
)
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402


def test_register_parts_cover_rows_in_fewer_registers():
    """A power-of-two block plus a power-of-two tail (at least a lane each) cover the row, in fewer entries than the
    next power of two whenever there is a tail; e.g. the 4K decode rows (4096 + a bucket: 5120 / 2560 entries)."""
    assert register_parts(5120) == (4096, 1024, 8) and register_parts(2560) == (2048, 512, 8)
    assert register_parts(4096) == (4096, 0, 8) and register_parts(7000) == (8192, 0, 16)
    for n in list(range(1, 300)) + [511, 513, 600, 1025, 3000, 4097, 6144, 6145, 8192]:
        block, tail, warps = register_parts(n)
        full = max(128, triton.next_power_of_2(n))
        assert block & (block - 1) == 0 and tail & (tail - 1) == 0 and block >= 128, n
        assert block + tail >= n and block >= 32 * warps, n
        assert (block + tail < full and tail >= 32 * warps) if tail else block == full, n
    assert split_config(33792, 512) == (9, 4096, 512, 8)  # V4.1's ratio-1 rows at 32K tokens: 4608 candidates


def _interp_matches_reference(k: int, with_lengths: bool, block_row_max: int, chunk: int) -> None:
    x, lengths = _hard_rows(3000, k)
    lengths = lengths if with_lengths else None
    got = topk_select_triton(x, k, lengths, block_row_max=block_row_max, chunk=chunk)
    assert torch.equal(got, topk_select_ref(x, k, lengths))
    mask = torch.rand(12, 3000, generator=torch.Generator().manual_seed(k)) < 0.6  # read by the kernel itself
    masked = topk_select_triton(x, k, lengths, mask, block_row_max=block_row_max, chunk=chunk)
    assert torch.equal(masked, topk_select_ref(x, k, lengths, mask))
    if chunk:  # twice: the last piece left the counters at zero
        assert torch.equal(topk_select_triton(x, k, lengths, block_row_max=block_row_max, chunk=chunk), got)


def _interp_strided_rows_and_invariance(block_row_max: int, chunk: int) -> None:
    x, lengths = _hard_rows(2100, 3)
    wide = torch.zeros(12, 2500)
    wide[:, :2100] = x
    view = wide[:, :2100]  # row stride 2500
    batch = topk_select_triton(view, 64, lengths, block_row_max=block_row_max, chunk=chunk)
    assert torch.equal(batch, topk_select_ref(x, 64, lengths))
    alone = topk_select_triton(x[9:10], 64, lengths[9:10], block_row_max=block_row_max, chunk=chunk)[0]
    assert torch.equal(alone, batch[9])


def _interp_ties_across_pieces() -> None:
    """Ties at the k-th key spread over several pieces: the lowest indices of the row win, so a piece's own
    choice among its ties must not decide (each piece here holds more ties than k)."""
    x = torch.full((3, 1000), 1.0)
    x[1, ::3] = 2.0  # 334 entries above the tie value: k = 400 takes 66 of the ties
    x[2, 700:] = float("-inf")
    for k in (50, 400):
        got = topk_select_triton(x, k, block_row_max=0, chunk=128)
        assert torch.equal(got, topk_select_ref(x, k)), k


def _interp_short_rows() -> None:
    """Rows shorter than the smallest register block (128) and than k."""
    for n, k in ((1, 1), (5, 512), (100, 7), (129, 64)):
        x, lengths = _hard_rows(n, n + k)
        assert torch.equal(topk_select_triton(x, k, lengths), topk_select_ref(x, k, lengths)), (n, k)


# (block_row_max, chunk): rows of 3000 / 2100 in registers, in 512-entry pieces (6 / 5 of them; k = 5000 is more
# than a piece: streamed), or streamed
KERNELS = {"block": (8192, 4096), "split": (0, 512), "stream": (0, 0)}
INTERP_CASES = {
    f"{kern}-k{k}-{'lengths' if lens else 'full'}": ("_interp_matches_reference", (k, lens, *KERNELS[kern]))
    for kern in KERNELS
    for k in (1, 16, 512, 5000)
    for lens in (True, False)
}
for _kern, _cfg in KERNELS.items():
    INTERP_CASES[f"{_kern}-strided-invariance"] = ("_interp_strided_rows_and_invariance", _cfg)
INTERP_CASES["short-rows"] = ("_interp_short_rows", ())
INTERP_CASES["split-ties-across-pieces"] = ("_interp_ties_across_pieces", ())


test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # every case in one TRITON_INTERPRET=1 child process


# ---- CUDA, indexer shapes -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1024, 2560, 4096, 5120, 8192, 8193, 32768, 33792, 131072])
def test_gpu_matches_reference(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.relu(torch.randn(64, n, generator=g, device="cuda")) * 3  # ReLU-weighted sums: zeros tie
    x = x.to(torch.bfloat16).float()  # bf16-rounded scores: many exact ties at every magnitude
    lengths = torch.randint(0, n + 1, (64,), generator=g, device="cuda")
    lengths[:4] = torch.tensor([0, 100, 511, 512])
    mask = torch.rand(64, n, generator=g, device="cuda") < 0.9
    out = topk_select_triton(x, 512, lengths, mask)  # the V4.1 candidate mask, read by the kernel
    x = x.masked_fill(~mask, float("-inf"))  # or written into the scores as -inf: the same rows
    assert torch.equal(out, topk_select_ref(x, 512, lengths))
    assert torch.equal(topk_select_triton(x, 512, lengths), out)
    for r in (0, 3, 40):
        assert torch.equal(topk_select_triton(x[r : r + 1].clone(), 512, lengths[r : r + 1])[0], out[r]), r
    # the other kernels give the same rows: the split one (pieces of 4096 / 2048 entries, whatever the rows), the
    # stream
    assert torch.equal(topk_select_triton(x, 512, lengths, block_row_max=0, chunk=0, grid_chunk=0), out)
    assert torch.equal(topk_select_triton(x, 512, lengths, grid_chunk=0), out)  # register / split / stream
    for chunk in (4096, 2048):
        if split_config(n, 512, chunk):
            forced = dict(block_row_max=0, chunk=chunk, split_programs=1 << 20, grid_chunk=0)
            got = topk_select_triton(x, 512, lengths, **forced)
            assert torch.equal(got, out), chunk
    # and the grid kernel, on as many rows as its pieces fit the SMs
    for chunk in (512, 1024, 2048):
        rows = max(1, min(64, sm_count(x.device) // triton.cdiv(n, chunk)))
        if grid_plan(n, rows, sm_count(x.device), chunk):
            got = topk_select_triton(x[:rows], 512, lengths[:rows], mask[:rows], grid_min=0, grid_chunk=chunk)
            assert torch.equal(got, out[:rows]), chunk
    assert not zeroed_scratch(x.device).any() and not counter_block(x.device).any(), "left as found"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [50000, 6000])
def test_gpu_hard_rows(n):
    x, lengths = _hard_rows(n, 1, device="cuda")
    for k in (1, 512, 2048, 60000):
        assert torch.equal(topk_select_triton(x, k, lengths), topk_select_ref(x, k, lengths)), k
    for k in (1, 512, 2048, 60000):  # the grid kernel: 2 rows of 6 / 49 pieces, and all 12 rows of 6
        got = topk_select_triton(x[:2], k, lengths[:2], grid_min=0, grid_chunk=1024)
        assert torch.equal(got, topk_select_ref(x[:2], k, lengths[:2])), k
        if n == 6000:
            got = topk_select_triton(x, k, lengths, grid_min=0, grid_chunk=1024)
            assert torch.equal(got, topk_select_ref(x, k, lengths)), k


@pytest.mark.gpu
def test_gpu_grid_kernel_ties_and_graph_replays():
    """Ties at the k-th key spread over the grid kernel's pieces (the row's lowest indices win), the V4 decode row
    (8448 entries, 8192 visible) from a CUDA graph replayed with new scores in place, twice per replay: the
    workspace and counters each launch leaves zeroed make the next one right."""
    x = torch.full((3, 9000), 1.0, device="cuda")
    x[1, ::3] = 2.0  # 3000 entries above the tie value: k = 3100 takes 100 of the ties, all in the first piece
    x[2, 7000:] = float("-inf")
    for k in (50, 512, 3100, 9000):
        assert torch.equal(topk_select_triton(x, k, grid_min=0, grid_chunk=512), topk_select_ref(x, k)), k
    g = torch.Generator(device="cuda").manual_seed(7)
    scores = torch.relu(torch.randn(2, 8448, generator=g, device="cuda"))
    lengths = torch.tensor([8192, 5000], device="cuda")
    static = scores.clone()
    topk_select_triton(static, 512, lengths)  # compile and warm outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = topk_select_triton(static, 512, lengths)
        second = topk_select_triton(static.flip(1).contiguous(), 512, lengths)
    for seed in range(3):
        static.copy_(torch.relu(torch.randn(2, 8448, generator=g, device="cuda")).to(torch.bfloat16).float())
        graph.replay()
        assert torch.equal(first, topk_select_ref(static, 512, lengths)), seed
        assert torch.equal(second, topk_select_ref(static.flip(1), 512, lengths)), seed
    assert 8448 >= GRID_MIN and grid_plan(8448, 2, sm_count(x.device)) == (512, 17), "V4's decode row: the grid"
