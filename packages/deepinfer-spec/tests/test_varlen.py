"""Procedure S on constructed confidences and costs."""

import pytest
import torch
from deepinfer_spec import (
    CostEstimator,
    VerifyCostModel,
    admit,
    choose_budget,
    placeholder_drafts,
    schedule_verify,
    survivals,
)


def test_survivals_are_running_products():
    c = torch.tensor([[0.9, 0.5, 1.0, 0.2], [1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    s = survivals(c, torch.tensor([4, 2, 0]))
    expected = torch.tensor([[0.9, 0.45, 0.45, 0.09], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(s, expected)
    # Without confidences: 1.0 per draft the request has, 0.0 otherwise (S.2).
    assert torch.equal(survivals(None, torch.tensor([2, 0, 3])), torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 1, 1]]))


def test_budget_maximises_expected_tokens_per_cost():
    cost = VerifyCostModel(graph_sizes=(2, 4, 8), baseline_ms=(10.0, 10.0, 20.0))
    prev = torch.tensor([[0.9, 0.8, 0.1], [0.5, 0.0, 0.0]])
    # B=2: 2/10; B=3: 2.9/10; B=4: 3.7/10 (best); B=5..8 cost 20: at most 4.3/20.
    assert choose_budget(prev, cost, num_requests=2) == 4
    # A per-row slope makes the 4-row graph dearer: 2/(10+2) = .167, 3.7/(10+4) = .264: still 4.
    assert choose_budget(prev, VerifyCostModel((2, 4, 8), (10.0, 10.0, 20.0), slope_ms=1.0), 2) == 4
    # With graph size 4 costing as much as 8, the extra rows are not worth it.
    assert choose_budget(prev, VerifyCostModel((2, 4, 8), (10.0, 30.0, 30.0)), 2) == 2
    # Capped by verify_budget and by the largest profiled graph.
    assert choose_budget(prev, cost, 2, max_rows=3) == 3
    assert choose_budget(prev, VerifyCostModel((2, 3), (10.0, 10.0)), 2) == 3
    assert choose_budget(prev, VerifyCostModel((1,), (10.0,)), 2) == 2  # more requests than any graph
    # Ties: equal scores keep the smaller budget (strictly greater replaces).
    assert choose_budget(torch.zeros(2, 3), cost, 2) == 2


def test_admission_is_a_prefix_with_stable_ties():
    s = torch.tensor([[0.9, 0.6, 0.3], [0.8, 0.7, 0.1], [0.0, 0.0, 0.0]])
    assert admit(s, budget=3).tolist() == [0, 0, 0]
    assert admit(s, budget=5).tolist() == [1, 1, 0]  # 0.9, 0.8
    assert admit(s, budget=7).tolist() == [2, 2, 0]  # + 0.7, 0.6
    assert admit(s, budget=100).tolist() == [3, 3, 3]
    ties = torch.full((2, 2), 0.5)
    assert admit(ties, budget=3).tolist() == [1, 0]  # lower flat index first
    assert admit(ties, budget=4).tolist() == [2, 0]
    with pytest.raises(ValueError, match="budget"):
        admit(s, budget=2)
    # Random confidences: always a prefix, and the admitted survivals dominate the rest.
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        c = torch.rand(6, 5, generator=gen)
        cur = survivals(c, torch.randint(0, 6, (6,), generator=gen))
        k = admit(cur, budget=6 + int(torch.randint(0, 31, (1,), generator=gen)))
        taken = torch.arange(5).unsqueeze(0) < k.unsqueeze(1)
        if taken.any() and (~taken).any():
            assert float(cur[taken].min()) >= float(cur[~taken].max())


def test_schedule_and_placeholders_after_prefill():
    cost = VerifyCostModel((2, 4, 8, 16), (10.0, 10.5, 11.0, 30.0))
    prev = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]])
    conf = torch.tensor([[0.95, 0.9, 0.5, 0.5], [0.2, 0.9, 0.9, 0.9]])
    k, budget = schedule_verify(conf, torch.tensor([4, 4]), prev, cost)
    assert budget == 8 and int(k.sum()) == 6
    assert k.tolist() == [4, 2]  # survivals .95 .855 .43 .21 | .2 .18 .16 .15
    # D6: fresh requests carry placeholder drafts with confidence 0; with no previous block the
    # budget is the anchors alone, so only the anchor rows are verified.
    ph = placeholder_drafts(2, 4, 16)
    k, budget = schedule_verify(ph.confidences, torch.tensor([4, 4]), torch.zeros(0, 4), cost)
    assert budget == 2 and k.tolist() == [0, 0]


def test_cost_estimator():
    est = CostEstimator(graph_sizes=(4, 8), baseline_ms=(10.0, 12.0))
    assert est.slope_ms() == 0.0 and est.sampler_ms(3) == 0.0
    for i in range(10):
        est.record_forward(4, 10.0 + 4 * 0.5)  # slope 0.5 ms/row at size 4
        est.record_forward(8, 12.0 + 8 * (1.0 + (i % 2)))  # 1.0 and 2.0 ms/row at size 8
    est.record_forward(8, 1000.0)  # an outlier only tips the size-8 median to 2.0
    est.record_forward(2, 50.0)  # an unprofiled size is ignored
    assert est.slope_ms() == pytest.approx((0.5 + 2.0) / 2)
    for ms in (1.0, 2.0, 3.0, 4.0):
        est.record_sampler(3, ms)
    est.record_sampler(5, 10.0)
    assert est.sampler_ms(3) == 3.0  # < 5 samples for 3 requests: the global median of 1,2,3,4,10
    est.record_sampler(3, 2.0)
    assert est.sampler_ms(3) == 2.0  # now the last samples of this request count: 1,2,3,4,2
    m = est.model(3)
    assert m.cost(5) == pytest.approx(12.0 + 1.25 * 8 + 2.0)
