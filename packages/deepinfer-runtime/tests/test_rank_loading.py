"""Per-rank checkpoint loading (``load_model(..., shard=LoadShard(...))``): a rank reads its routed-expert slots
and its Engram rows only, and holds exactly what the unsharded load holds for those slots and rows."""

import pytest
import torch
from deepinfer_runtime import load_model
from deepinfer_runtime.loader.shard import LoadShard
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="module")
def v4_fp4(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("rl") / "v4", "v4", "fp8+fp4", seed=2)


@pytest.fixture(scope="module")
def v41_fp4(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("rl") / "v41", "v4.1", "fp8+fp4", seed=3)


# 8 experts + 2 redundant slots over 2 ranks: slot p holds expert p mod 8, 5 consecutive slots per rank
@pytest.mark.parametrize("rank, experts", [(0, [0, 1, 2, 3, 4]), (1, [5, 6, 7, 0, 1])])
def test_v4_rank_reads_only_its_expert_slots(v4_fp4, rank, experts):
    full = load_model(v4_fp4, dtype=torch.float32, progress=False)
    part = load_model(v4_fp4, dtype=torch.float32, progress=False, shard=LoadShard(rank, 2, True, 2))
    whole, mine = full.load_stats, part.load_stats
    assert mine.routed_experts() == {("layers", layer): set(experts) for layer in range(len(full.layers))}
    others = {n for n in whole.tensors if ".ffn.experts." not in n}
    assert others <= set(mine.tensors), "every non-expert tensor is read in full"
    assert all(mine.tensors[n] == whole.tensors[n] for n in others)
    expert_bytes = whole.bytes_of(contains=".ffn.experts.")
    assert mine.bytes_read == whole.bytes_read - expert_bytes + expert_bytes * len(set(experts)) // 8
    for block, ref in zip(part.layers, full.layers, strict=True):
        assert block.ffn.experts.slot_experts == tuple(experts)
        assert torch.equal(block.ffn.experts.w13, ref.ffn.experts.w13[experts])
        assert torch.equal(block.ffn.experts.w2, ref.ffn.experts.w2[experts])
        assert torch.equal(block.ffn.gate.weight, ref.ffn.gate.weight)


def test_v41_rank_reads_its_engram_rows_and_experts(v41_fp4):
    full = load_model(v41_fp4, dtype=torch.float32, progress=False)
    part = load_model(v41_fp4, dtype=torch.float32, progress=False, shard=LoadShard(1, 2))
    mine = part.load_stats
    read = mine.routed_experts()
    # 16 experts over 2 ranks: rank 1 holds 8..15 of every backbone layer; the 3 DSpark stages keep their 8
    assert {k: v for k, v in read.items() if k[0] == "layers"} == {
        ("layers", layer): set(range(8, 16)) for layer in range(len(full.layers))
    }
    assert {k: v for k, v in read.items() if k[0] == "mtp"} == {("mtp", s): set(range(8)) for s in range(3)}
    tables = [(i, b.engram) for i, b in enumerate(full.layers) if getattr(b, "engram", None) is not None]
    assert tables
    for index, ref in tables:
        engram = part.layers[index].engram
        n = ref.rows.shape[0]
        lo, hi = (n + 1) // 2, n  # rank 1 of 2: the upper block of B = ceil(n / 2) rows
        assert engram.row_range == (lo, hi, n)
        assert torch.equal(engram.rows.view(torch.uint8), ref.rows[lo:hi].view(torch.uint8))
        assert torch.equal(engram.scale.view(torch.uint8), ref.scale[lo:hi].view(torch.uint8))
        name = f"layers.{index}.engram.embed"
        assert mine.tensors[name + ".weight"] == (hi - lo) * ref.rows.shape[1]  # fp8: one byte per value
        assert mine.tensors[name + ".scale"] == (hi - lo) * ref.scale.shape[1]
        with pytest.raises(RuntimeError, match="lookups need sharding"):  # a shard alone cannot serve lookups
            engram.gather(torch.zeros(1, 1, dtype=torch.long), torch.float32, torch.device("cpu"))
    assert mine.bytes_read < full.load_stats.bytes_read


def test_shard_that_does_not_split_is_refused(v4_fp4):
    with pytest.raises(ValueError, match="do not split over 2 ranks"):
        load_model(v4_fp4, progress=False, shard=LoadShard(0, 2, True, 1))
