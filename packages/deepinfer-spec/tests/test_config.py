"""SpeculativeConfig: vLLM's dict shape, DeepInfer's environment variables, validation."""

import pytest
from deepinfer_spec import SpeculativeConfig


def test_defaults_and_off_switch():
    assert SpeculativeConfig.from_engine_arg(None, env={}) is None
    assert SpeculativeConfig.from_engine_arg(None, env={"DEEPINFER_USE_NEXTN_DECODE": "0"}) is None
    cfg = SpeculativeConfig.from_engine_arg(None, env={"DEEPINFER_USE_NEXTN_DECODE": "3"})
    assert (cfg.method, cfg.num_speculative_tokens, cfg.verification, cfg.varlen) == ("dspark", 3, "rejection", False)
    cfg = SpeculativeConfig.from_engine_arg({"method": "dspark"}, env={})
    assert cfg.num_speculative_tokens == 5 and cfg.confidence_temperatures == (1.0,) and cfg.deterministic


def test_vllm_shape_and_aliases_win_over_env():
    env = {
        "DEEPINFER_USE_NEXTN_DECODE": "2",
        "DEEPINFER_ENABLE_MTP_VARLEN": "1",
        "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE": "0.5,1,1,2,0",
    }
    cfg = SpeculativeConfig.from_engine_arg({"method": "mtp", "num_speculative_tokens": 5}, env=env)
    assert cfg.method == "mtp" and cfg.num_speculative_tokens == 5 and cfg.varlen and not cfg.deterministic
    assert cfg.confidence_temperatures == (0.5, 1.0, 1.0, 2.0, 1e-5)  # floored at 1e-5 (D2)
    assert cfg.confidence_temperature(0) == 0.5 and cfg.confidence_temperature(4) == 1e-5
    cfg = SpeculativeConfig.from_engine_arg(
        {"rejection_sample_method": "block", "enable_adaptive_verification": False, "confidence_temperature": 0.7},
        env=env,
    )
    assert cfg.verification == "block" and not cfg.varlen and cfg.num_speculative_tokens == 2
    assert cfg.confidence_temperature(1) == 0.7
    cfg = SpeculativeConfig.from_engine_arg({"verification": "rejection", "varlen": True, "verify_budget": 64}, env={})
    assert cfg.varlen and cfg.verify_budget == 64


@pytest.mark.parametrize(
    ("arg", "env", "field"),
    [
        ({"method": "eagle"}, {}, "method"),
        ({"num_speculative_tokens": 0}, {}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 33}, {}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.0}, {}, "num_speculative_tokens"),
        ({"verification": "greedy"}, {}, "verification"),
        ({"rejection_sample_method": "tree"}, {}, "rejection_sample_method"),
        ({"varlen": "yes"}, {}, "varlen"),
        ({"verify_budget": 0}, {}, "verify_budget"),
        ({"confidence_temperature": [1.0, 2.0]}, {}, "confidence_temperature"),
        ({"confidence_temperature": -1.0}, {}, "confidence_temperature"),
        ({"draft_tensor_parallel_size": 1}, {}, "draft_tensor_parallel_size"),
        ({"model": "/some/draft"}, {}, "model"),
        (None, {"DEEPINFER_USE_NEXTN_DECODE": "five"}, "DEEPINFER_USE_NEXTN_DECODE"),
        (None, {"DEEPINFER_USE_NEXTN_DECODE": "40"}, "DEEPINFER_USE_NEXTN_DECODE"),
        ({}, {"DEEPINFER_ENABLE_MTP_VARLEN": "maybe"}, "DEEPINFER_ENABLE_MTP_VARLEN"),
        ({}, {"DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE": "1;2"}, "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE"),
        ("dspark", {}, "speculative_config"),
    ],
)
def test_bad_values_name_the_field(arg, env, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_engine_arg(arg, env=env)


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="confidence_temperature"):
        SpeculativeConfig(num_speculative_tokens=3, confidence_temperatures=(1.0, 1.0))
    cfg = SpeculativeConfig(num_speculative_tokens=3, confidence_temperatures=(1.0, 2.0, 3.0))
    assert cfg.with_overrides(verification="block").verification == "block"
    with pytest.raises(ValueError, match="draft index"):
        cfg.confidence_temperature(3)
