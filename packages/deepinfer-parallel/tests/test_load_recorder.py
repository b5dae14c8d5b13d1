"""LoadRecorder window / interval semantics and the EPLB knobs."""

import pytest
import torch
from deepinfer_parallel import EplbConfig, LoadRecorder


def test_window_keeps_last_steps_only():
    rec = LoadRecorder(num_layers=2, num_experts=4, window_size=3, step_interval=5)
    due = []
    for step in range(7):
        rec.record(0, torch.tensor([[step % 4, (step + 1) % 4]]))
        rec.record(1, torch.tensor([3, -1]))  # -1 (padding) ignored
        due.append(rec.step())
    assert due == [False, False, False, False, True, False, False]
    # window 3 = the open step (empty) + the last 2 completed steps (steps 5, 6)
    expect = torch.zeros(4, dtype=torch.int64)
    for step in (5, 6):
        expect[step % 4] += 1
        expect[(step + 1) % 4] += 1
    assert rec.load()[0].tolist() == expect.tolist()
    assert rec.load()[1].tolist() == [0, 0, 0, 2]
    with pytest.raises(ValueError):
        rec.record(0, torch.tensor([4]))


def test_config_from_env(monkeypatch):
    assert EplbConfig.from_env() == EplbConfig(1000, 3000, 0)
    monkeypatch.setenv("DEEPINFER_EPLB_WINDOW_SIZE", "10")
    monkeypatch.setenv("DEEPINFER_EPLB_STEP_INTERVAL", "20")
    monkeypatch.setenv("DEEPINFER_EPLB_NUM_REDUNDANT_EXPERTS", "32")
    assert EplbConfig.from_env() == EplbConfig(10, 20, 32)
    assert EplbConfig.from_env(window_size=5) == EplbConfig(5, 20, 32)  # engine argument wins
    monkeypatch.setenv("DEEPINFER_EPLB_WINDOW_SIZE", "0")
    with pytest.raises(ValueError, match="DEEPINFER_EPLB_WINDOW_SIZE"):
        EplbConfig.from_env()
    monkeypatch.setenv("DEEPINFER_EPLB_WINDOW_SIZE", "abc")
    with pytest.raises(ValueError, match="not an integer"):
        EplbConfig.from_env()


def test_global_load_sums_ranks(ranks):
    import parallel_workers as W

    outs = ranks(2, W.recorder_global, 3, 8)
    total = sum(local for local, _ in outs)
    assert int(total.sum()) == 2 * 3 * 3 * 5 * 2
    for _, global_load in outs:
        assert torch.equal(global_load, total)
