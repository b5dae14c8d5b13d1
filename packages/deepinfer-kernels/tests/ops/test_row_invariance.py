"""Row invariance of the references in fp32 on the CPU: every output row must be bitwise identical
whatever other rows are in the call (batch size, order, chunking). This is what lets a full
forward and an incremental decode agree bit for bit, and the basis of batch-invariant mode.

Each test computes an op on a batch of ROWS rows, then again on chunks of 1, 5, 16 and 17
consecutive rows, a permutation and random subsets, and requires every row to match exactly.
Dims are small but not trivial (K up to 1280, N up to 704): invariance failures of CPU GEMMs show
up at larger K. The indexer is also checked for invariance in the number of keys (decode grows it).
"""

from collections.abc import Callable

import pytest
import torch
from deepinfer_kernels import (
    ROW_TILE,
    engram_gate_inject,
    grouped_linear,
    indexer_scores,
    kv_compress_pool,
    linear,
    mhc_coefficients,
    mhc_collapse,
    mhc_expand,
    mhc_head_weights,
    moe_experts,
    moe_route_hash,
    moe_route_topk,
    rms_norm,
    rope_interleaved,
    rope_inv_freq,
    sparse_mqa_attention,
    swiglu_clamp,
    swiglu_mlp,
)
from deepinfer_kernels.ops.indexer import reference as indexer_reference
from deepinfer_kernels.ops.mhc import MhcConfig, MhcParams
from deepinfer_kernels.testing.compare import assert_bitwise

ROWS = 37
CHUNKS = (1, 5, 16, 17)


@pytest.fixture(autouse=True)
def _force_reference(monkeypatch):
    """The property under test belongs to the references: route every op to its reference."""
    monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def _selections(n: int, seed: int) -> list[torch.Tensor]:
    """Chunks of every size in CHUNKS (size 1 = each row alone), a permutation, random subsets."""
    g = _gen(seed)
    rows = torch.arange(n)
    out = [rows[i : i + size] for size in CHUNKS for i in range(0, n, size)]
    out.append(torch.randperm(n, generator=g))
    out += [torch.randperm(n, generator=g)[:size] for size in (2, 5, 16, 17, n - 4)]
    return out


def _as_tuple(x) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _check_rows(fn: Callable[[torch.Tensor], object], what: str, n: int = ROWS, seed: int = 0) -> None:
    """``fn(idx)`` runs the op on rows ``idx`` of its inputs; each output's rows must equal the
    full call's rows ``idx`` bitwise."""
    full = _as_tuple(fn(torch.arange(n)))
    assert all(f.dtype == torch.float32 for f in full), what
    for idx in _selections(n, seed):
        got = _as_tuple(fn(idx))
        assert len(got) == len(full)
        for i, (a, f) in enumerate(zip(got, full)):
            assert_bitwise(a, f[idx], f"{what} output {i}, rows {idx.tolist()}")


# ----------------------------------------------------------------------------------------------
# linear


@pytest.mark.parametrize(("k", "n"), [(1280, 700), (1024, 512), (320, 129), (64, 24), (1280, 1)])
def test_linear_rows(k, n):
    g = _gen(k + n)
    x = _randn(g, ROWS, k)
    w = _randn(g, n, k, std=k**-0.5)
    _check_rows(lambda idx: linear(x[idx], w), f"linear K={k} N={n}")


def test_linear_leading_dims_and_tile_position():
    g = _gen(1)
    x = _randn(g, 3, 13, 768)
    w = _randn(g, 96, 768)
    y = linear(x, w)
    assert y.shape == (3, 13, 96) and y.dtype == torch.float32
    flat = x.reshape(-1, 768)
    assert_bitwise(y.reshape(-1, 96), linear(flat, w), "leading dims vs flat")
    # a row gives the same bits at every position of a tile and in any tile
    row = flat[7]
    for pos in (0, 1, ROW_TILE - 1, ROW_TILE, 2 * ROW_TILE + 3):
        batch = _randn(g, pos + 5, 768)
        batch[pos] = row
        assert_bitwise(linear(batch, w)[pos], y.reshape(-1, 96)[7], f"row at position {pos}")
    assert linear(x[:0], w).shape == (0, 13, 96)
    assert linear(x[0, 0], w).shape == (96,)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


def test_linear_weight_cast_and_validation():
    g = _gen(2)
    x = _randn(g, 5, 64)
    w = _randn(g, 8, 64).to(torch.bfloat16)
    assert_bitwise(linear(x, w), linear(x, w.float()), "bf16 weight upcast exactly")
    with pytest.raises(ValueError):
        linear(x, _randn(g, 8, 63))


# ----------------------------------------------------------------------------------------------
# mHC (n = 4 streams of d = 320: the flattened K is 1280)

HC_N, HC_D = 4, 320


def _mhc_inputs(seed: int):
    g = _gen(seed)
    x = _randn(g, ROWS, HC_N, HC_D)
    rows = (2 + HC_N) * HC_N
    params = MhcParams(_randn(g, rows, HC_N * HC_D, std=0.05), _randn(g, rows, std=0.3), torch.tensor([0.9, 1.1, 1.3]))
    return g, x, params


def test_mhc_coefficients_rows():
    _, x, params = _mhc_inputs(10)
    cfg = MhcConfig(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    _check_rows(lambda idx: mhc_coefficients(x[idx], params, cfg), "mhc_coefficients")


def test_mhc_head_weights_rows():
    g, x, _ = _mhc_inputs(11)
    fn, base, scale = _randn(g, HC_N, HC_N * HC_D, std=0.05), _randn(g, HC_N), torch.tensor([0.7])
    _check_rows(lambda idx: mhc_head_weights(x[idx], fn, base, scale, norm_eps=1e-6, hc_eps=1e-6), "mhc_head_weights")


def test_mhc_collapse_rows():
    g, x, _ = _mhc_inputs(12)
    w = torch.rand(ROWS, HC_N, generator=g)
    _check_rows(lambda idx: mhc_collapse(x[idx], w[idx]), "mhc_collapse")


def test_mhc_expand_rows():
    g, x, _ = _mhc_inputs(13)
    y = _randn(g, ROWS, HC_D)
    post = torch.rand(ROWS, HC_N, generator=g) * 2
    comb = torch.softmax(_randn(g, ROWS, HC_N, HC_N), dim=-1)
    _check_rows(lambda idx: mhc_expand(x[idx], y[idx], post[idx], comb[idx]), "mhc_expand")


# ----------------------------------------------------------------------------------------------
# MoE (d = 1024, intermediate 352: w13 has N = 704 rows)

MOE_D, MOE_I, MOE_E, MOE_K = 1024, 352, 8, 3


def test_moe_experts_rows_random_routing():
    g = _gen(20)
    x = _randn(g, ROWS, MOE_D)
    experts = torch.stack([torch.randperm(MOE_E, generator=g)[:MOE_K] for _ in range(ROWS)])
    weights = torch.rand(ROWS, MOE_K, generator=g)
    w13 = _randn(g, MOE_E, 2 * MOE_I, MOE_D, std=MOE_D**-0.5)
    w2 = _randn(g, MOE_E, MOE_D, MOE_I, std=MOE_I**-0.5)
    _check_rows(lambda idx: moe_experts(x[idx], experts[idx], weights[idx], w13, w2, swiglu_limit=10.0), "moe_experts")
    # the k picks of a token may come in any slot order: the sum is the same bits either way,
    # because the reference always adds a token's experts in ascending expert id
    flipped = moe_experts(x, experts.flip(-1), weights.flip(-1), w13, w2, swiglu_limit=10.0)
    assert_bitwise(flipped, moe_experts(x, experts, weights, w13, w2, swiglu_limit=10.0), "slot order")


def test_swiglu_mlp_rows():
    g = _gen(21)
    x = _randn(g, ROWS, MOE_D)
    w1, w3 = _randn(g, 700, MOE_D, std=MOE_D**-0.5), _randn(g, 700, MOE_D, std=MOE_D**-0.5)
    w2 = _randn(g, MOE_D, 700, std=700**-0.5)
    _check_rows(lambda idx: swiglu_mlp(x[idx], w1, w3, w2, swiglu_limit=10.0), "swiglu_mlp")


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_moe_routing_rows(scoring):
    g = _gen(22)
    logits = _randn(g, ROWS, 64, std=3.0)
    bias = _randn(g, 64, std=0.1)
    _check_rows(lambda r: moe_route_topk(logits[r], bias, 6, route_scale=1.5, scoring=scoring)[0], f"topk {scoring}")
    table = torch.randint(0, 64, (50, 6), generator=g)
    ids = torch.randint(0, 50, (ROWS,), generator=g)
    _check_rows(lambda r: moe_route_hash(logits[r], table, ids[r], route_scale=1.5, scoring=scoring)[0], "hash")


def test_swiglu_clamp_rows():
    g = _gen(23)
    gate, up = _randn(g, ROWS, 700, std=4.0), _randn(g, ROWS, 700, std=4.0)
    _check_rows(lambda r: swiglu_clamp(gate[r], up[r], 10.0), "swiglu_clamp")
    _check_rows(lambda r: swiglu_clamp(gate[r], up[r], None), "swiglu_clamp no limit")


# ----------------------------------------------------------------------------------------------
# grouped linear (4 groups, Din 1280, Dout 256)


def test_grouped_linear_rows():
    g = _gen(30)
    x = _randn(g, ROWS, 4, 1280)
    w = _randn(g, 4 * 256, 1280, std=1280**-0.5)
    _check_rows(lambda idx: grouped_linear(x[idx], w), "grouped_linear")


# ----------------------------------------------------------------------------------------------
# indexer scores: invariant in the number of queries AND the number of keys

IDX_H, IDX_DH, IDX_N = 64, 128, 150


def _indexer_inputs(seed: int):
    g = _gen(seed)
    q = _randn(g, 2, ROWS, IDX_H, IDX_DH)
    k = _randn(g, 2, IDX_N, IDX_DH)
    w = _randn(g, 2, ROWS, IDX_H) * IDX_H**-0.5
    return q, k, w


def test_indexer_scores_rows():
    q, k, w = _indexer_inputs(40)
    # rows are query positions s (the op is [B, S, ...]); move them first for the check
    _check_rows(lambda idx: indexer_scores(q[:, idx], k, w[:, idx], IDX_DH**-0.5).transpose(0, 1), "indexer_scores")


def test_indexer_scores_keys_grow():
    q, k, w = _indexer_inputs(41)
    full = indexer_scores(q, k, w, IDX_DH**-0.5)
    for n in (0, 1, 2, 5, 16, 17, 64, IDX_N - 1):
        assert_bitwise(indexer_scores(q, k[:, :n], w, IDX_DH**-0.5), full[..., :n], f"first {n} keys")
    # a decode step: one query row against a growing key prefix
    for s in (0, 18, ROWS - 1):
        for n in (1, 33, IDX_N):
            got = indexer_scores(q[:, s : s + 1], k[:, :n], w[:, s : s + 1], IDX_DH**-0.5)
            assert_bitwise(got, full[:, s : s + 1, :n], f"query {s}, first {n} keys")
    # one batch alone
    assert_bitwise(indexer_scores(q[1:], k[1:], w[1:], IDX_DH**-0.5), full[1:], "batch 1 alone")


def test_indexer_scores_chunking_is_invisible(monkeypatch):
    q, k, w = _indexer_inputs(42)
    full = indexer_scores(q, k, w, IDX_DH**-0.5)
    pair = 4 * IDX_H * IDX_DH
    for budget in (1, pair, 3 * pair, 40 * pair, 1000 * pair):  # 1 key, a few keys, several queries
        monkeypatch.setattr(indexer_reference, "_SCORES_CHUNK_BYTES", budget)
        assert_bitwise(indexer_scores(q, k, w, IDX_DH**-0.5), full, f"chunk budget {budget}")


# ----------------------------------------------------------------------------------------------
# sparse MQA attention, KV compression, RMSNorm, RoPE


def test_sparse_mqa_attention_rows():
    g = _gen(50)
    h, d, n, topk = 16, 512, 300, 64
    q = _randn(g, ROWS, h, d)
    kv = _randn(g, n, d)
    idx = torch.stack([torch.randperm(n, generator=g)[:topk] for _ in range(ROWS)])
    idx[::3, -7:] = -1  # some unused slots
    idx[5] = -1  # a fully masked row
    sinks = _randn(g, h)
    _check_rows(lambda r: sparse_mqa_attention(q[r], kv, idx[r], sinks, d**-0.5), "sparse_mqa_attention")


@pytest.mark.parametrize(("slots", "channels"), [(8, 512), (128, 64)])
def test_kv_compress_pool_rows(slots, channels):
    g = _gen(60 + slots)
    kv = _randn(g, ROWS, slots, channels)
    score = _randn(g, ROWS, slots, channels)
    score[0, : slots // 2] = float("-inf")  # empty slots (first CSA window)
    _check_rows(lambda r: kv_compress_pool(kv[r], score[r]), f"kv_compress_pool L={slots}")


def test_rms_norm_rows():
    g = _gen(70)
    x = _randn(g, ROWS, 1280)
    w = _randn(g, 1280)
    _check_rows(lambda r: rms_norm(x[r], w, 1e-6), "rms_norm weighted")
    _check_rows(lambda r: rms_norm(x[r], None, 1e-20), "rms_norm unweighted")


def test_rope_interleaved_rows():
    g = _gen(80)
    x = _randn(g, ROWS, 4, 192)
    positions = torch.randint(0, 100_000, (ROWS,), generator=g)
    inv_freq = rope_inv_freq(64, 10000.0)
    _check_rows(lambda r: rope_interleaved(x[r], positions[r], inv_freq), "rope_interleaved")
    _check_rows(lambda r: rope_interleaved(x[r], positions[r], inv_freq, inverse=True), "rope_interleaved inverse")


def test_engram_gate_inject_rows():
    g = _gen(90)
    x, key = _randn(g, ROWS, 4, 1280), _randn(g, ROWS, 4, 1280)
    value, w = _randn(g, ROWS, 1280), _randn(g, 4, 1280)
    image = torch.rand(ROWS, generator=g) < 0.2
    _check_rows(lambda r: engram_gate_inject(x[r], key[r], value[r], w, None), "engram_gate_inject")
    _check_rows(lambda r: engram_gate_inject(x[r], key[r], value[r], w, image[r]), "engram_gate_inject image mask")
