"""``load_model``: a checkpoint directory -> a ready model (config parsed, weights decoded)."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch

from deepinfer_runtime.errors import CheckpointError, ConfigError
from deepinfer_runtime.loader.safetensors_dir import SafetensorsDir
from deepinfer_runtime.loader.shard import LoadShard, LoadStats
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
    mtp: bool = False,
    dspark: bool = False,
    shard: LoadShard | None = None,
    **v41_options,
) -> torch.nn.Module:
    """Load the model in ``path`` (config.json + safetensors) with weights dequantised to ``dtype``.

    Supported architectures: ``DeepseekV4ForCausalLM`` and ``DeepseekV41ForCausalLM``. The returned model has
    ``forward_logits(input_ids [B, S]) -> float logits [B, S, V]``. V4.1 options: ``fake_quant`` (the trained
    KV quantisers; False makes them the identity), ``yoco_mode`` (off | mask | compact), ``yoco_keep_tokens``,
    ``engram_device`` (where the Engram tables live). V4 options: ``mtp`` also loads the MTP layers ``mtp.*`` (the
    drafter of speculative method "mtp"), ``dspark`` the DSpark stages ``mtp.*`` of a V4-Flash-0731 checkpoint
    (method "dspark"). V4.1 has no MTP layer; its DSpark head is always loaded.

    ``shard``: read only one rank's part of the checkpoint (its routed-expert slots, its Engram rows; see
    ``loader/shard.py``); the model then holds that part only and is meant for ``deepinfer_runtime.distributed``.
    ``model.load_stats`` (``LoadStats``) says what was read.
    """
    start = time.perf_counter()
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
        if v41_options:
            raise ValueError(f"options {sorted(v41_options)} apply to DeepSeek-V4.1 only")
        from deepinfer_runtime.models.deepseek_v4 import DeepseekV4ForCausalLM
        from deepinfer_runtime.models.deepseek_v4_config import DeepseekV4Config
        from deepinfer_runtime.models.deepseek_v4_weights import (
            model_param_for,
            v4_dspark_inventory,
            v4_inventory,
            v4_mtp_inventory,
        )

        cfg = DeepseekV4Config.from_file(config_file)
        if mtp and cfg.dspark is not None:
            raise ConfigError(
                f"{config_file}: this checkpoint's mtp.* are DSpark stages (dspark_target_layer_ids): use speculative "
                "method 'dspark'"
            )
        if mtp and cfg.num_nextn_predict_layers < 1:
            raise ConfigError(
                f"{config_file}: num_nextn_predict_layers is 0: this checkpoint has no MTP layer for speculative "
                "method 'mtp'"
            )
        if dspark and cfg.dspark is None:
            raise ConfigError(
                f"{config_file}: no DSpark head (no dspark_target_layer_ids): speculative method 'dspark' needs a "
                "V4-Flash-0731 checkpoint"
            )
        ckpt = SafetensorsDir(path)
        # the draft heads (mtp.*) serve speculative decoding only: loaded when asked for. DSpark's confidence head is
        # optional (vLLM loads it when present; without it drafts carry no confidences)
        confidence = dspark and f"mtp.{cfg.dspark.num_stages - 1}.confidence_head.proj.weight" in ckpt.names()
        model, local = _build(
            lambda: DeepseekV4ForCausalLM(cfg, dtype=dtype, mtp=mtp, dspark=dspark, confidence_head=confidence),
            shard,
            cfg.n_routed_experts,
        )
        inventory = v4_inventory(cfg)
        inventory += v4_mtp_inventory(cfg) if mtp else v4_dspark_inventory(cfg, confidence) if dspark else []
        ignore = () if mtp or dspark else ("mtp.",)
        load_weights(
            model,
            inventory,
            ckpt,
            cfg.quant,
            model_param_for,
            ignore_prefixes=ignore,
            progress=progress,
            local_experts=local,
        )
        return _finish(model.to(device).eval(), ckpt, start)
    if arch == "DeepseekV41ForCausalLM":
        if mtp:
            raise ValueError("DeepSeek-V4.1 has no MTP layer: its draft head is DSpark (speculative method 'dspark')")
        model, ckpt = _load_v41(path, dtype, device, progress, shard, **v41_options)
        return _finish(model, ckpt, start)
    raise ConfigError(
        f"{config_file}: architecture {arch!r} is not supported (have: DeepseekV4ForCausalLM, DeepseekV41ForCausalLM)"
    )


def _build(make_model, shard: LoadShard | None, num_experts: int) -> tuple[torch.nn.Module, list[int] | None]:
    """``make_model()``, with a shard: its backbone expert stacks sized to the rank's slots (never the whole
    model's). Returns the model and the rank's logical expert per local slot (None: every expert)."""
    from deepinfer_runtime.models.layers import Experts, deferred_experts

    local = None if shard is None else shard.local_experts(num_experts)
    if local is None:
        return make_model(), None
    with deferred_experts():
        model = make_model()
    for name, module in model.named_modules():
        if isinstance(module, Experts):  # the DSpark stages (mtp.*) keep every expert
            module.allocate_(local if name.startswith("layers.") else None)
    return model, local


def _finish(model: torch.nn.Module, ckpt: SafetensorsDir, start: float) -> torch.nn.Module:
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    model.load_stats = LoadStats(
        ckpt.bytes_read, ckpt.file_bytes(), dict(ckpt.read_log), time.perf_counter() - start, peak_kib * 1024
    )
    return model


def _load_v41(
    path: Path,
    dtype: torch.dtype,
    device,
    progress: bool,
    shard: LoadShard | None,
    fake_quant: bool = True,
    yoco_mode: str | None = None,
    yoco_keep_tokens: int | None = None,
    engram_device: str | None = None,
):
    """V4.1: decode every tensor except the Engram tables, which keep their stored format on
    ``engram_device`` (default: host memory when the model goes to an accelerator, else the model device).
    Returns the model and the checkpoint it was read from."""
    from deepinfer_kernels.ops.engram import compressed_token_map
    from tqdm import tqdm

    from deepinfer_runtime.loader.weights import check_inventory, load_engram_table, load_tensor
    from deepinfer_runtime.models.deepseek_v4_weights import model_param_for
    from deepinfer_runtime.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer_runtime.models.deepseek_v41_config import DeepseekV41Config
    from deepinfer_runtime.models.deepseek_v41_weights import ENGRAM_TABLE, v41_inventory

    cfg = DeepseekV41Config.from_file(path / "config.json")
    tokenizer = path / "tokenizer.json"
    if not tokenizer.exists():
        raise CheckpointError(f"{path}: no tokenizer.json (V4.1's Engram hashes compressed token ids built from it)")
    ckpt = SafetensorsDir(path)
    inventory = v41_inventory(cfg)
    # vision weights may be absent from text-only checkpoints; image inputs are refused by the model
    check_inventory(inventory, ckpt, ignore_prefixes=("vision.", "aligner.", "image_"))
    model, local = _build(
        lambda: DeepseekV41ForCausalLM(
            cfg, dtype=dtype, fake_quant=fake_quant, yoco_mode=yoco_mode, yoco_keep_tokens=yoco_keep_tokens
        ),
        shard,
        cfg.n_routed_experts,
    )
    params = dict(model.named_parameters())
    table_device = torch.device(engram_device or ("cpu" if torch.device(device).type != "cpu" else device))
    for spec in tqdm(inventory, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        if spec.role == ENGRAM_TABLE:
            row_range = None if shard is None else shard.engram_rows(spec.shape[0])
            rows, scale = load_engram_table(spec, ckpt, cfg.quant, row_range)
            if table_device.type == "cpu" and torch.cuda.is_available():
                rows = rows.pin_memory()
                scale = scale.pin_memory() if scale is not None else None
            module = model.get_submodule(spec.name.rsplit(".", 2)[0])  # layers.L.engram
            module.set_table(
                rows.to(table_device),
                None if scale is None else scale.to(table_device),
                None if row_range is None else (*row_range, spec.shape[0]),
            )
            continue
        load_tensor(spec, ckpt, cfg.quant, params, model_param_for, local)
    token_map = compressed_token_map(tokenizer, expected_size=cfg.engram_compressed_vocab_size)
    if token_map.shape[0] != cfg.vocab_size:
        raise CheckpointError(f"{tokenizer}: {token_map.shape[0]} token ids, config vocab_size {cfg.vocab_size}")
    model.engram_token_map.copy_(token_map)
    tables = {n: (m.rows, m.scale, m.row_range) for n, m in model.named_modules() if hasattr(m, "set_table")}
    model = model.to(device).eval()
    for name, table in tables.items():  # .to(device) must not move the tables
        model.get_submodule(name).set_table(*table)
    return model, ckpt
