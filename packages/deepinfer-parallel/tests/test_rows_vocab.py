"""Row-sharded tables (Engram) and vocabulary-parallel embedding / logits over gloo equal the unsharded results."""

import parallel_workers as W
import pytest
import torch
from deepinfer_parallel import RowSharding, shard_rows


def test_row_sharding_blocks():
    sh = RowSharding(10, 4)
    assert [(sh.start(r), sh.stop(r)) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert sh.owner(torch.tensor([0, 2, 3, 9])).tolist() == [0, 0, 1, 3]
    t = torch.arange(10)
    assert torch.cat([shard_rows(t, 4, r) for r in range(4)]).tolist() == list(range(10))


@pytest.mark.parametrize("world", [2, 4])
def test_gather_rows(world, ranks):
    num_ids = [50, 0, 17, 3][:world]
    outs = ranks(world, W.rows_gather, 1001, 264, num_ids)
    assert [n for _, _, n in outs] == num_ids
    for rows_ok, scales_ok, _ in outs:
        assert rows_ok and scales_ok


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_layers(world, ranks):
    outs = ranks(world, W.vocab_layers, 1030, 16, [9, 4, 0, 7][:world])  # 1030 rows: uneven shards
    for emb, emb_ref, logits, logits_ref in outs:
        assert emb.dtype == torch.bfloat16 and torch.equal(emb, emb_ref)
        assert logits.shape == logits_ref.shape and logits.dtype == torch.float32
        torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
