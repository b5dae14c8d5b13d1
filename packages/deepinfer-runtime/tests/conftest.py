"""Shared fixtures: tiny V4 checkpoints written once per test session."""

import pytest
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

# name -> config overrides. Together they cover sliding-window-only, CSA (ratio 4) and HCA
# layers (ratio 16 and the released 128), hash-routed and score-routed MoE.
TINY_V4 = {
    "mixed": {},
    "released_ratios": {
        "compress_ratios": [4, 128, 0],
        "num_hidden_layers": 3,
        "num_hash_layers": 1,
        "compress_rate_hca": 128,
        "sliding_window": 32,
    },
    "routed_only": {
        "compress_ratios": [4, 0, 4],
        "num_hidden_layers": 3,
        "num_hash_layers": 0,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "index_topk": 4,
    },
}


@pytest.fixture(scope="session")
def tiny_v4_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_v4")
    return {
        name: write_tiny_checkpoint(root / name, "v4", "none", seed=i, config=cfg)
        for i, (name, cfg) in enumerate(TINY_V4.items())
    }
