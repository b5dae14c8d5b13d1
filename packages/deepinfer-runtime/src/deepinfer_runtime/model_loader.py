"""``load_model``: a checkpoint directory -> a ready model (config parsed, weights decoded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deepinfer_runtime.errors import CheckpointError, ConfigError
from deepinfer_runtime.loader.safetensors_dir import SafetensorsDir
from deepinfer_runtime.loader.weights import load_weights

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} unsupported; use one of float32, bfloat16, float16")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} unsupported; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.bfloat16,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> torch.nn.Module:
    """Load the model in ``path`` (config.json + safetensors) with weights dequantised to ``dtype``.

    Supported architectures: ``DeepseekV4ForCausalLM``. The returned model has
    ``forward_logits(input_ids [B, S]) -> float logits [B, S, V]``.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{config_file}: missing") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_file}: not valid JSON ({exc})") from None
    arch = (raw.get("architectures") or ["DeepseekV4ForCausalLM"])[0]
    dtype = _dtype(dtype)
    if arch == "DeepseekV4ForCausalLM":
        from deepinfer_runtime.models.deepseek_v4 import DeepseekV4ForCausalLM
        from deepinfer_runtime.models.deepseek_v4_config import DeepseekV4Config
        from deepinfer_runtime.models.deepseek_v4_weights import model_param_for, v4_inventory

        cfg = DeepseekV4Config.from_file(config_file)
        ckpt = SafetensorsDir(path)
        model = DeepseekV4ForCausalLM(cfg, dtype=dtype)
        # the MTP head (mtp.*) belongs to speculative decoding; it is not part of this model
        load_weights(
            model, v4_inventory(cfg), ckpt, cfg.quant, model_param_for, ignore_prefixes=("mtp.",), progress=progress
        )
        return model.to(device).eval()
    raise ConfigError(f"{config_file}: architecture {arch!r} is not supported (have: DeepseekV4ForCausalLM)")
