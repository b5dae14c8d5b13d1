"""Model slices for benchmarks: the real DeepSeek-V4.1-Flash / V4-Flash dimensions with a subset of the
released layers (each kept layer keeps its kind), random weights made directly on the device, request
caches replicated by value, and transformers' V4 model built over the same weight tensors.

* ``v41_slice_config(layers)``: the released V4.1-Flash text config restricted to ``layers`` (default
  ``V41_SLICE_LAYERS`` = 0, 1, 2, 3, 20, 21, 24, 25: window, window + Engram, ratio-2 KV source, ratio-2
  reuse, ratio-1 KV + candidate source (the YOCO boundary), ratio-1 reuse, re-index, re-index reuse), with the
  source / index-source / candidate / Engram ids renumbered, a reduced Engram table and no DSpark head.
* ``v4_slice_config(layer_types, hash_layers)``: V4-Flash dimensions (transformers' defaults) with the given
  layers (default the peer slice of ``../shared/docs/performance.md``: CSA, HCA, CSA, HCA, first hash-routed).
* ``build_random_model(cfg)``: the model with random weights (same conventions as ``tiny_checkpoint``). The
  routed experts are made separately (``experts="distinct"`` per layer, or ``"shared"``: one stacked tensor
  pair used by every layer, so that a bf16 slice with V4.1's 384 x 2304 experts fits one GPU).
* ``balance_routers_(model)``: the top-k routers' selection biases set as DeepSeek's auxiliary-loss-free balancing
  trains them (each expert's bias moved against its load's excess), so that the random weights route tokens the
  way a trained model's balanced routers do instead of onto the few experts a random bias favours.
* ``clone_state(cache)``: a deep copy of a request cache with every tensor compacted (``.clone()``);
  ``replicate_cache(cache, n, ...)``: n copies laid out like the engine's requests (one slot pool, paged rows).
* ``hf_v4_sharing_weights(model, raw)``: transformers' ``DeepseekV4ForCausalLM`` whose parameters are our
  model's tensors (shared storage where the dtypes agree).
"""

from __future__ import annotations

import array
import copy
import dataclasses
import math
import re
from typing import Any

import torch
from deepinfer_kernels import engram_table_primes
from deepinfer_kernels.ops.engram import compressed_token_map  # noqa: F401  (re-exported for callers)
from torch import nn

from deepinfer_runtime.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_runtime.models.deepseek_v4 import Gate as V4Gate
from deepinfer_runtime.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer_runtime.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_runtime.models.deepseek_v41 import Gate as V41Gate
from deepinfer_runtime.models.deepseek_v41_config import DeepseekV41Config
from deepinfer_runtime.models.layers import Experts, quantize_weights_

# The released DeepSeek-V4.1-Flash text config (config.json ``text_config``), without the DSpark head.
RELEASED_V41_TEXT: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    },
    "compress_rope_theta": 160000,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 0,
}
V41_SLICE_LAYERS = (0, 1, 2, 3, 20, 21, 24, 25)

# V4-Flash (transformers 5.23.0's DeepseekV4Config defaults = the released dimensions)
V4_FLASH: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "compress_rates": {CSA: 4, HCA: 128},
    "max_position_embeddings": 1048576,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}
V4_SLICE_LAYER_TYPES = (CSA, HCA, CSA, HCA)


def _renumber(ids, layers: tuple[int, ...], what: str, required: set[int] = frozenset()) -> list[int]:
    kept = [layers.index(i) for i in ids if i in layers]
    for i in required:
        if i not in layers:
            raise ValueError(f"slice {layers}: {what} layer {i} is needed by a kept layer but is not kept")
    return kept


def v41_slice_raw(
    layers: tuple[int, ...] = V41_SLICE_LAYERS,
    engram_vocab_size: int = 200_000,
    base: dict[str, Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The flat text config dict of a V4.1 slice: ``layers`` of ``base`` (default the release), renumbered
    0..len-1. Every kept ratio>0 layer's KV source, index source and (for re-index layers) the candidate
    source must be kept too. The Engram table is reduced to ``engram_vocab_size`` buckets per head."""
    src = copy.deepcopy(RELEASED_V41_TEXT if base is None else base)
    src.update(overrides)
    full = DeepseekV41Config.from_dict(dict(src))
    layers = tuple(layers)
    if list(layers) != sorted(set(layers)) or not all(0 <= i < full.num_hidden_layers for i in layers):
        raise ValueError(f"layers {layers} must be increasing backbone layer ids")
    needed_kv = {full.kv_source_of(i) for i in layers if full.compress_ratio(i)}
    needed_ix = {full.index_source_of(i) for i in layers if full.compress_ratio(i)}
    raw = dict(src)
    raw["num_hidden_layers"] = len(layers)
    raw["compress_ratios"] = [full.compress_ratios[i] for i in layers]
    raw["kv_source_layer_ids"] = _renumber(full.kv_source_layer_ids, layers, "KV source", needed_kv)
    raw["index_source_layer_ids"] = _renumber(full.index_source_layer_ids, layers, "index source", needed_ix)
    cand = full.candidate_source_layer_id
    uses_cand = any(
        full.layer_role(i) in ("reindex",) and full.kv_source_of(i) == cand for i in layers if cand is not None
    )
    if cand is not None and (cand in layers or uses_cand):
        raw["candidate_source_layer_id"] = _renumber([cand], layers, "candidate source", {cand})[0]
    else:
        raw["candidate_source_layer_id"] = -1
    engram = _renumber(full.engram_layer_ids, layers, "Engram")
    raw["engram_layer_ids"] = engram
    if engram:
        primes = engram_table_primes(
            engram_vocab_size, len(engram), full.engram_max_ngram_size - 1, full.engram_n_heads
        )
        raw["engram_vocab_size"] = engram_vocab_size
        raw["engram_num_embeddings"] = [sum(p) for p in primes]
    else:
        raw["engram_num_embeddings"] = []
    raw["num_nextn_predict_layers"] = 0
    for key in ("dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts"):
        raw.pop(key, None)
    return raw


def v41_slice_config(layers: tuple[int, ...] = V41_SLICE_LAYERS, **kw: Any) -> DeepseekV41Config:
    return DeepseekV41Config.from_dict(v41_slice_raw(layers, **kw))


def v4_slice_raw(
    layer_types: tuple[str, ...] = V4_SLICE_LAYER_TYPES, hash_layers: int = 1, **overrides: Any
) -> dict[str, Any]:
    """V4-Flash config dict (HF-native spelling, readable by our parser and by transformers) with the given
    per-layer attention kinds and ``hash_layers`` leading hash-routed MoE layers."""
    raw = copy.deepcopy(V4_FLASH)
    raw["num_hidden_layers"] = len(layer_types)
    raw["layer_types"] = list(layer_types)
    raw["mlp_layer_types"] = ["hash_moe"] * hash_layers + ["moe"] * (len(layer_types) - hash_layers)
    raw.update(overrides)
    return raw


def v4_slice_config(layer_types: tuple[str, ...] = V4_SLICE_LAYER_TYPES, hash_layers: int = 1, **kw):
    return DeepseekV4Config.from_dict(v4_slice_raw(layer_types, hash_layers, **kw))


# ----------------------------------------------------------------------------------------------------------
# Random weights
# ----------------------------------------------------------------------------------------------------------
def _fill_random(name: str, t: torch.Tensor, gen: torch.Generator) -> None:
    """In-place random values by parameter name (the conventions of ``tiny_checkpoint._random_tensor``)."""

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=t.device, dtype=torch.float32)

    shape = tuple(t.shape)
    if not t.is_floating_point():
        return
    if name.endswith("norm.weight") or name.endswith(("engram.q_weight", "engram.k_weight")):
        t.copy_(1.0 + 0.1 * randn(*shape))
    elif name.startswith("hc_") or ".hc_" in name:
        if name.endswith("_fn"):
            t.copy_(0.5 * randn(*shape) / math.sqrt(shape[1]))
        elif name.endswith("_scale"):
            t.copy_(0.5 + torch.rand(shape, generator=gen, device=t.device))
        else:
            t.copy_(0.5 * randn(*shape))
    elif name.endswith(("attn_sink", ".ape", "gate.bias", "gate.bias_vl")):
        t.copy_(0.5 * randn(*shape))
    elif name == "embed.weight":
        t.copy_(randn(*shape))
    elif t.dim() == 3:  # stacked experts: one expert at a time keeps the fp32 temporary small
        for e in range(shape[0]):
            t[e].copy_(randn(*shape[1:]) / math.sqrt(shape[-1]))
    else:
        t.copy_(randn(*shape) / math.sqrt(shape[-1]))


def _moe_modules(model: nn.Module):
    return [m for m in model.modules() if hasattr(m, "experts") and isinstance(m.experts, Experts)]


def build_random_model(
    cfg: DeepseekV41Config | DeepseekV4Config,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    experts: str = "distinct",
    quant: str = "none",
    engram_host: bool = False,
    **model_kw: Any,
) -> nn.Module:
    """The model of ``cfg`` on ``device`` with random weights.

    The model is first built with ``num_experts_per_tok`` routed experts (so that building never holds the
    bf16 experts of every layer at once), then each MoE gets its full-size router and experts:
    ``experts="distinct"`` one random stack per layer, ``"shared"`` one stack used by every layer (the
    bytes a step reads from memory are the same; only the footprint shrinks). V4.1: the Engram tables are
    random FP8 rows with UE8M0 scales (``engram_host``: in pinned host memory, where the loader puts them on a
    GPU) and the token map a random compression; V4: random hash tables.

    ``quant="fp8+fp4"`` keeps the weights in the released formats inside the model (``quantize_weights_``):
    each layer's experts become MXFP4 as soon as they are made (so a V4.1 slice with distinct experts fits),
    the dense Linears FP8 with 32x32 (V4.1) or 128x128 (V4) UE8M0 scales.
    """
    if experts not in ("distinct", "shared"):
        raise ValueError(f"experts must be 'distinct' or 'shared', got {experts!r}")
    if quant not in ("none", "fp8+fp4"):
        raise ValueError(f"quant must be 'none' or 'fp8+fp4', got {quant!r}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    k = cfg.num_experts_per_tok
    small = dataclasses.replace(cfg, n_routed_experts=k)
    is_v41 = isinstance(cfg, DeepseekV41Config)
    if is_v41:
        small = dataclasses.replace(small, dspark_n_routed_experts=min(cfg.dspark_n_routed_experts, k))
    with torch.device(device):
        model = (DeepseekV41ForCausalLM if is_v41 else DeepseekV4ForCausalLM)(small, dtype, **model_kw)
    for m in model.modules():  # the modules keep the real config
        if getattr(m, "cfg", None) is small:
            m.cfg = cfg
    e, inter, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    shared: Experts | None = None
    for moe in _moe_modules(model):
        gate = moe.gate
        gate.weight = nn.Parameter(torch.empty(e, d, dtype=dtype, device=device), requires_grad=False)
        for b in ("bias", "bias_vl"):
            if hasattr(gate, b):
                setattr(gate, b, nn.Parameter(torch.empty(e, dtype=torch.float32, device=device), requires_grad=False))
        if hasattr(gate, "tid2eid"):
            rows = torch.stack([torch.randperm(e, generator=gen, device=device)[:k] for _ in range(64)])
            pick = torch.randint(0, 64, (cfg.vocab_size,), generator=gen, device=device)
            gate.tid2eid = rows[pick]
        if experts == "shared" and shared is not None:
            moe.experts = shared
            continue
        w13 = nn.Parameter(torch.empty(e, 2 * inter, d, dtype=dtype, device=device), requires_grad=False)
        w2 = nn.Parameter(torch.empty(e, d, inter, dtype=dtype, device=device), requires_grad=False)
        with torch.no_grad():
            _fill_random("experts.w13", w13.data, gen)
            _fill_random("experts.w2", w2.data, gen)
        moe.experts.w13, moe.experts.w2 = w13, w2
        if quant != "none":
            moe.experts.quantize_mxfp4_()
        if experts == "shared":
            shared = moe.experts
    seen: set[int] = {id(m.experts.w13) for m in _moe_modules(model) if not m.experts.quantized}
    seen |= {id(m.experts.w2) for m in _moe_modules(model) if not m.experts.quantized}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        with torch.no_grad():
            _fill_random(name, p.data, gen)
    if is_v41:
        for m in model.modules():
            if hasattr(m, "set_table"):
                n_rows = cfg.engram_num_embeddings[m.index]
                rows = torch.randn(n_rows, cfg.engram_head_dim, generator=gen, device=device).to(torch.float8_e4m3fn)
                scale = torch.full((n_rows, cfg.engram_head_dim // 32), 127, dtype=torch.uint8, device=device)
                scale = scale.view(torch.float8_e8m0fnu)
                if engram_host and torch.device(device).type == "cuda":  # where the loader puts them on a GPU
                    rows, scale = rows.cpu().pin_memory(), scale.cpu().pin_memory()
                m.set_table(rows, scale)
        model.engram_token_map.copy_(
            torch.randint(0, cfg.engram_compressed_vocab_size, (cfg.vocab_size,), generator=gen, device=device)
        )
    if quant != "none":
        quantize_weights_(model, 32 if is_v41 else 128, experts=True)
    return model.eval()


@torch.no_grad()
def balance_routers_(
    model: nn.Module, tokens: int = 2048, iters: int = 32, step: float = 0.1, decay: float = 0.95, seed: int = 0
) -> list[float]:
    """Set every top-k router's selection bias (``gate.bias``: the checkpoint's ``e_score_correction_bias``, added
    to the scores only to choose the experts) the way DeepSeek's auxiliary-loss-free load balancing trains it, each
    expert's bias moved against its load's excess: ``iters`` forwards of ``tokens`` random token ids (a fresh
    request each, no prompt length: no YOCO truncation, every layer on every row), after each every bias moves by
    -step * log((load + 1) / (mean + 1)), clipped to +-0.3, the step shrinking by ``decay`` a round. (The trainer's
    fixed-size sign step needs thousands of rounds; a proportional step gets to the sampling noise in a few dozen.
    At V4.1's router shapes, 384 experts x 6 of 8192 random normed rows, from a worst max / mean load of 36-64 to
    1.32-1.35 and a least-loaded expert at 0.70-0.73 of the mean, also when the rows share a strong common
    direction, where a decaying sign step left experts idle.) Hash-routed layers (no bias) are left alone.

    Why: ``build_random_model`` draws the biases at random (0.5 x N(0, 1), larger than the spread of the scores),
    which sends nearly every token to the few experts with the largest bias (the V4.1 slice: ~90 of 384 experts
    take all 1536 rows of a batch-256 decode step), unlike a trained model, whose biases exist to spread the load.
    Expert GEMMs over few, tall experts run nearer the tensor-core rate and a decode step reads fewer experts, so
    benchmarks should say which routing they ran.

    Returns the worst layer's max / mean expert load in each round, before its update (1.0: perfectly even)."""
    gates = [m for m in model.modules() if isinstance(m, (V4Gate, V41Gate)) and hasattr(m, "bias")]
    if not gates:
        return []
    counts: dict[int, torch.Tensor] = {}

    def hook(i):
        def fn(_mod, _inp, out):
            ids = out[1].reshape(-1).long()
            counts[i] = counts.get(i, 0) + torch.bincount(ids, minlength=gates[i].bias.numel())

        return fn

    handles = [g.register_forward_hook(hook(i)) for i, g in enumerate(gates)]
    dev = gates[0].bias.device
    gen = torch.Generator().manual_seed(seed)
    top = min(model.cfg.vocab_size, 129000)  # below the special ids (an image token would be refused)
    ratios = []
    try:
        for _ in range(iters):
            counts.clear()
            ids = torch.randint(3, top, (tokens,), generator=gen)
            model.forward_step([ids.to(dev)], [model.new_cache()], logit_rows=[torch.tensor([tokens - 1])])
            worst = 0.0
            for i, g in enumerate(gates):
                load = counts[i].float()
                mean = load.mean()
                g.bias.sub_(torch.clamp(step * torch.log((load + 1) / (mean + 1)), -0.3, 0.3))
                worst = max(worst, float(load.max() / mean))
            ratios.append(worst)
            step *= decay
    finally:
        for h in handles:
            h.remove()
    return ratios


# ----------------------------------------------------------------------------------------------------------
# Request caches
# ----------------------------------------------------------------------------------------------------------
def clone_state(obj: Any, _memo: dict[int, Any] | None = None) -> Any:
    """A deep copy of a request cache in which every tensor is ``.clone()``d (a view of a larger buffer
    becomes a compact tensor of its own, unlike ``copy.deepcopy``, which copies the whole storage).
    Functions and other immutable leaves (frozen dataclasses such as ``SlotSpec``) are shared. A cache over a
    slot of a ``SlotPool`` gets a copy of the whole pool (clone caches of ``new_cache()``'s private one-slot pools),
    its rings compact copies of their rows."""
    memo = {} if _memo is None else _memo
    if id(obj) in memo:
        return memo[id(obj)]
    frozen = dataclasses.is_dataclass(obj) and obj.__dataclass_params__.frozen
    if frozen:
        out = obj
    elif isinstance(obj, torch.Tensor):
        out = obj.clone()
    elif isinstance(obj, array.array):  # a slot pool's ring bounds (its rings share it: memo keeps that)
        out = array.array(obj.typecode, obj)
    elif isinstance(obj, dict):
        out = {k: clone_state(v, memo) for k, v in obj.items()}
    elif isinstance(obj, list):
        out = [clone_state(v, memo) for v in obj]
    elif isinstance(obj, tuple):
        out = tuple(clone_state(v, memo) for v in obj)
    elif hasattr(obj, "__dict__") and not callable(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        memo[id(obj)] = out
        for k, v in vars(obj).items():
            setattr(out, k, clone_state(v, memo))
        return out
    else:
        out = obj
    memo[id(obj)] = out
    return out


def replicate_cache(base: Any, n: int, pools: Any, table: list[int], free_blocks: Any, spare_blocks: int = 1) -> list:
    """``n`` copies of request cache ``base`` that decode together as one batch, laid out as the engine's requests
    are: their fixed-size state in the request slots of one new ``SlotPool``, their paged rows (``base`` made with
    ``pools.factory(table)``) sharing base's blocks except the last, which each copy gets a copy of, plus
    ``spare_blocks`` more from ``free_blocks`` (an iterator of unused block ids) to grow into."""
    from deepinfer_runtime.slot_pool import SlotPool

    slots = SlotPool(base.slots.pool.specs, n, 0, next(iter(base.slots.pool.buffers.values())).device)
    copies = []
    for _ in range(n):
        own = table[:-1] + [next(free_blocks) for _ in range(1 + spare_blocks)]
        for pool in pools.pools.values():
            pool.data[own[len(table) - 1]] = pool.data[table[-1]]
        memo = {id(pools): pools, id(table): own, **{id(p): p for p in pools.pools.values()}}
        copy_ = clone_state(base, memo)
        state = slots.claim()
        for key, ring in copy_.slots.rings.items():  # the copy's rings (the objects its cache holds) move in
            ring.move_into(state.rings[key])
        state.rings = copy_.slots.rings
        copy_.slots = state
        copies.append(copy_)
    return copies


# ----------------------------------------------------------------------------------------------------------
# transformers' V4 model over our tensors
# ----------------------------------------------------------------------------------------------------------
# transformers 5.23.0 conversion_mapping.py, "deepseek_v4": checkpoint name -> HF name, applied in order
_HF_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.experts\.w13$", ".experts.gate_up_proj"),  # stacked: [E, 2I, d] = cat(w1, w3) as HF merges them
    (r"\.experts\.w2$", ".experts.down_proj"),
]


def hf_v4_name(ours: str) -> str:
    """Our V4 parameter / buffer name -> transformers' (``model.`` prefix except ``lm_head``)."""
    name = ours
    for pat, rep in _HF_RENAMES:
        name = re.sub(pat, rep, name)
    return name if name.startswith("lm_head") else "model." + name


def hf_v4_sharing_weights(model: DeepseekV4ForCausalLM, raw: dict[str, Any], dtype: torch.dtype = torch.bfloat16):
    """transformers 5.23.0 ``DeepseekV4ForCausalLM`` for config dict ``raw`` whose weights are ``model``'s:
    a parameter whose dtype agrees with ours is the same tensor; others are converted copies. transformers'
    ``_keep_in_fp32_modules(_strict)`` stay fp32, everything else is ``dtype`` (as ``from_pretrained(dtype=)``).
    Built with ``num_experts_per_tok`` experts first, then given our full-size routers and experts."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM as HFModel

    cfg = model.cfg
    device = model.embed.weight.device
    keys = {k: v for k, v in raw.items() if k not in ("architectures",)}
    small = HFConfig(**{**keys, "n_routed_experts": cfg.num_experts_per_tok})
    small._attn_implementation = "eager"
    with torch.device(device):
        hf = HFModel(small)
    # as from_pretrained: the strict list stays fp32 in bf16 and fp16, the plain list only in fp16
    fp32 = list(getattr(HFModel, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        fp32 += list(getattr(HFModel, "_keep_in_fp32_modules", None) or [])
    ours = dict(model.named_parameters(remove_duplicate=False))
    ours.update(dict(model.named_buffers()))
    hf_params = dict(hf.named_parameters(remove_duplicate=False))
    hf_buffers = dict(hf.named_buffers())
    mapped = {hf_v4_name(n): t for n, t in ours.items() if not n.endswith("inv_freq")}
    missing = sorted(set(hf_params) - set(mapped))
    if missing:
        raise KeyError(f"transformers parameters with no counterpart in our model: {missing[:8]}")
    for name, t in mapped.items():
        if name in hf_params:
            want = torch.float32 if any(f in name for f in fp32) else dtype
            mod_name, attr = name.rsplit(".", 1)
            value = t if t.dtype == want else t.to(want)
            setattr(hf.get_submodule(mod_name), attr, nn.Parameter(value, requires_grad=False))
        elif name in hf_buffers:
            mod_name, attr = name.rsplit(".", 1)
            old = hf_buffers[name]
            hf.get_submodule(mod_name).register_buffer(attr, t.to(old.dtype), persistent=True)
        else:
            raise KeyError(f"our tensor {name!r} has no counterpart in transformers' model")
    e = cfg.n_routed_experts
    for m in hf.modules():
        if hasattr(m, "num_experts"):
            m.num_experts = e
    hf.config.n_routed_experts = e
    if hasattr(hf.config, "num_local_experts"):
        hf.config.num_local_experts = e
    return hf.eval()


__all__ = [
    "RELEASED_V41_TEXT",
    "V41_SLICE_LAYERS",
    "V4_FLASH",
    "V4_SLICE_LAYER_TYPES",
    "SLIDING",
    "build_random_model",
    "clone_state",
    "hf_v4_name",
    "hf_v4_sharing_weights",
    "v41_slice_config",
    "v41_slice_raw",
    "v4_slice_config",
    "v4_slice_raw",
]
