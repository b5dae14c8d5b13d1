"""SpecStats definitions on hand-made steps."""

import json

import pytest
import torch
from deepinfer_spec import SpecStats


def test_counts_and_rates():
    stats = SpecStats()
    stats.record("a", proposed=5, verified=5, accepted=2)
    stats.record("a", proposed=5, verified=3, accepted=3)
    stats.record("b", proposed=5, verified=0, accepted=0)
    stats.record("b", proposed=5, verified=5, accepted=0, placeholder=True)  # D6 step: not counted
    d = stats.as_dict()
    assert d["spec_verify_steps"] == 3
    assert d["spec_draft_tokens_proposed"] == 15 and d["spec_draft_tokens_verified"] == 8
    assert d["spec_draft_tokens_accepted"] == 5 and d["spec_tokens_emitted"] == 8
    assert d["spec_mean_accepted_length"] == pytest.approx(8 / 3)
    assert d["spec_acceptance_rate"] == pytest.approx(5 / 8)
    assert d["spec_position_verified"] == [2, 2, 2, 1, 1]
    assert d["spec_position_accepted"] == [2, 2, 1, 0, 0]
    assert d["spec_position_acceptance_rates"] == [1.0, 1.0, 0.5, 0.0, 0.0]
    a = stats.request_metrics("a")
    assert a["spec_mean_accepted_length"] == 3.5 and a["spec_tokens_emitted"] == 7
    assert stats.pop_request("b")["spec_verify_steps"] == 1 and "b" not in stats.requests
    assert stats.as_dict()["spec_verify_steps"] == 3
    json.dumps(stats.as_dict())


def test_batch_record_and_validation():
    stats = SpecStats()
    stats.record_batch(["x", "y"], torch.tensor([4, 4]), torch.tensor([4, 2]), torch.tensor([1, 2]))
    assert stats.as_dict()["spec_draft_tokens_accepted"] == 3
    with pytest.raises(ValueError, match="accepted"):
        stats.record("x", 4, 2, 3)
    with pytest.raises(ValueError, match="exceeds proposed"):
        stats.record("x", 1, 2, 0)
    with pytest.raises(ValueError, match="one entry per request"):
        stats.record_batch(["x"], [1, 2], [1, 2], [0, 0])
    assert SpecStats().as_dict()["spec_mean_accepted_length"] == 0.0
