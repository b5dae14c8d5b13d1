"""engram_hash_ids: the one-launch Triton kernel vs the reference, bitwise (integer hashing), under Triton's
interpreter on CPU and on CUDA: the released V4.1 multipliers and primes (products close to 2^63 from the largest
compressed id), DEAD tokens, a chunk with and without history, another n-gram order and head count, a decode
step's [rows, 1] shape, and a CUDA-graph replay with new ids."""

import pytest
import torch
from deepinfer_kernels import engram_hash_ids, engram_multipliers, engram_table_primes
from deepinfer_kernels.ops.engram import DEAD
from deepinfer_kernels.ops.engram.reference import engram_hash_ids_ref

pytest.importorskip("triton")

from deepinfer_kernels.testing.compare import assert_bitwise  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

VOCAB = 99092  # V4.1's compressed vocabulary


def _case(batch: int, seq: int, history: bool, max_ngram: int, heads: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    comp = torch.randint(0, VOCAB, (batch, seq), generator=g)
    comp = comp.masked_fill(torch.rand(batch, seq, generator=g) < 0.1, DEAD)
    if seq:
        comp[0, 0] = VOCAB - 1  # the largest id: v * M[s] comes close to 2^63
    hist = None
    if history:
        hist = torch.randint(0, VOCAB, (batch, max_ngram - 1), generator=g)
        hist = hist.masked_fill(torch.rand(hist.shape, generator=g) < 0.2, DEAD)
    mults = torch.tensor(engram_multipliers(14, VOCAB, max_ngram))
    primes = torch.tensor(engram_table_primes(16_000_000, 2, max_ngram - 1, heads)[1])
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(comp), to(hist), to(mults), to(primes)


def _interp_matches_reference(batch, seq, history, max_ngram, heads):
    from deepinfer_kernels.ops.engram.hash_triton import engram_hash_ids_triton

    args = _case(batch, seq, history, max_ngram, heads, "cpu", seed=batch * seq + max_ngram)
    got = engram_hash_ids_triton(*args, 2)
    assert_bitwise(got, engram_hash_ids_ref(*args, 2), f"{batch}x{seq} history={history} n={max_ngram}")


INTERP_CASES = {
    f"{b}x{s}-hist{int(h)}-n{n}-h{k}": ("_interp_matches_reference", (b, s, h, n, k))
    for b, s, h, n, k in ((3, 70, False, 4, 8), (2, 5, True, 4, 8), (5, 1, True, 4, 8), (2, 9, True, 3, 3))
}
test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq, history", [(1, 1, True), (256, 1, True), (1, 8192, False), (4, 600, True)])
def test_gpu_bitwise(batch, seq, history):
    from deepinfer_kernels.ops.engram.hash_triton import engram_hash_ids_triton

    args = _case(batch, seq, history, 4, 8, "cuda", seed=batch + seq)
    assert_bitwise(engram_hash_ids_triton(*args, 2), engram_hash_ids_ref(*args, 2), f"{batch}x{seq}")
    assert_bitwise(engram_hash_ids(*args, 2), engram_hash_ids_ref(*args, 2), "dispatched")


@pytest.mark.gpu
def test_gpu_graph_replay_with_new_ids():
    comp, hist, mults, primes = _case(8, 1, True, 4, 8, "cuda", seed=1)
    engram_hash_ids(comp, hist, mults, primes, 2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = engram_hash_ids(comp, hist, mults, primes, 2)
    new_comp, new_hist, _, _ = _case(8, 1, True, 4, 8, "cuda", seed=2)
    comp.copy_(new_comp)
    hist.copy_(new_hist)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, engram_hash_ids_ref(new_comp, new_hist, mults, primes, 2), "replay")
