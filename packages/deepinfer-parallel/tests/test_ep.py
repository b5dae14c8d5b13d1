"""EP dispatch/combine over gloo with 2 and 4 ranks equals the single-process MoE (moe_experts + shared expert)."""

import parallel_workers as W
import pytest
import torch
from deepinfer_parallel import default_placement
from deepinfer_parallel.ep import choose_replicas

CASES = {
    # world: tokens per rank (one rank with none at world 4)
    2: [37, 21],
    4: [19, 0, 33, 8],
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ep_moe_exact_equals_single_process(world, dtype, ranks):
    outs = ranks(world, W.ep_vs_reference, 3, 16, 4, 4, 24, 16, CASES[world], dtype, "exact")
    remote_pairs = 0
    for rank, (out, ref, remote) in enumerate(outs):
        assert out.shape == (CASES[world][rank], 24) and out.dtype == dtype
        assert torch.equal(out, ref), f"rank {rank}: max |diff| {(out.float() - ref.float()).abs().max()}"
        remote_pairs += remote
    assert remote_pairs > 0  # pairs really crossed ranks


@pytest.mark.parametrize("world", [2, 4])
def test_ep_moe_reduced_close_to_single_process(world, ranks):
    outs = ranks(world, W.ep_vs_reference, 5, 16, 4, 6, 24, 16, CASES[world], torch.float32, "reduced")
    for out, ref, _ in outs:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_choose_replicas_round_robin():
    placement = default_placement(4, 2, num_redundant=4)  # every expert twice: slots e and e + 4
    experts = torch.tensor([[0, 1]] * 4)
    phys = choose_replicas(experts, placement, rank=0)
    assert phys[:, 0].tolist() == [0, 4, 0, 4]  # alternates between replicas by token index
    assert choose_replicas(experts, placement, rank=1)[:, 0].tolist() == [4, 0, 4, 0]  # offset by rank
