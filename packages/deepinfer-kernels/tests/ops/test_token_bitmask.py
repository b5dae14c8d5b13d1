"""apply_token_bitmask against an independent formulation (per-token word lookup with integer division),
on fresh random inputs, including vocabularies that are not a multiple of 32 and the sign bit."""

import pytest
import torch
from deepinfer_kernels import apply_token_bitmask
from deepinfer_kernels.ops.token_bitmask.reference import apply_token_bitmask_ref


def _random_bitmask(g: torch.Generator, batch: int, vocab: int, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A random allowed-set [B, V] bool and its packed int32 bitmask [B, ceil(V/32)] (padding bits random)."""
    words = (vocab + 31) // 32
    allowed = torch.rand(batch, words * 32, generator=g) < density
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (allowed.view(batch, words, 32).long() * weights).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)  # two's complement
    return allowed[:, :vocab], packed


def _independent(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> torch.Tensor:
    """Token v is allowed iff (word // 2^bit) is odd, computed in int64 on the unsigned word value."""
    out = logits.clone()
    vocab = logits.shape[1]
    tok = torch.arange(vocab)
    word = bitmask.long()[:, tok // 32] % (1 << 32)  # unsigned value of the word holding each token
    keep = torch.div(word, 2 ** (tok % 32), rounding_mode="floor") % 2 == 1
    sel = range(logits.shape[0]) if rows is None else rows.tolist()
    for b in sel:
        out[b, ~keep[b]] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 1000, 4099])
@pytest.mark.parametrize("use_rows", [False, True])
def test_matches_independent_formulation(vocab, use_rows):
    g = torch.Generator().manual_seed(vocab * 2 + use_rows)
    batch = 7
    allowed, bitmask = _random_bitmask(g, batch, vocab, density=0.4)
    logits = torch.randn(batch, vocab, generator=g)
    rows = torch.tensor([5, 0, 3]) if use_rows else None
    want = _independent(logits, bitmask, rows)
    got = apply_token_bitmask(logits.clone(), bitmask, rows)
    assert torch.equal(got, want)
    if rows is None:  # and the packing in this test agrees with both
        assert torch.equal(got != float("-inf"), allowed)


def test_in_place_and_untouched_rows_and_all_ones():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 100, generator=g)
    before = logits.clone()
    _, bitmask = _random_bitmask(g, 4, 100, density=0.1)
    bitmask[2] = -1  # all allowed
    out = apply_token_bitmask(logits, bitmask, torch.tensor([1, 2]))
    assert out.data_ptr() == logits.data_ptr()
    assert torch.equal(logits[[0, 3]], before[[0, 3]]), "rows outside `rows` must not change"
    assert torch.equal(logits[2], before[2]), "an all-ones row leaves the logits bitwise unchanged"
    assert torch.isinf(logits[1]).any()


def test_row_invariant():
    """Each row's result is the same alone and in any batch (elementwise op)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 333, generator=g)
    _, bitmask = _random_bitmask(g, 9, 333, density=0.5)
    full = apply_token_bitmask_ref(logits.clone(), bitmask, None)
    for b in range(9):
        alone = apply_token_bitmask_ref(logits[b : b + 1].clone(), bitmask[b : b + 1], None)
        assert torch.equal(alone[0], full[b])


def test_bad_shapes():
    with pytest.raises(ValueError, match="words per row"):
        apply_token_bitmask(torch.zeros(2, 65), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        apply_token_bitmask(torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32))
