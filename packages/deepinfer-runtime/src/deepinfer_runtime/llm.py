"""``LLM``: the offline API (vLLM's shape). Build once, then ``generate`` or ``chat`` in batches.

from deepinfer_runtime import LLM, SamplingParams
llm = LLM(model="/path/to/DeepSeek-V4.1-Flash")          # no model: a cached tiny random V4.1 checkpoint
outs = llm.generate(["Hello", "def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from deepinfer_runtime.engine.kv_cache import BlockAllocator, CacheBudget
from deepinfer_runtime.engine.llm_engine import LLMEngine
from deepinfer_runtime.engine.model_runner import ModelRunner
from deepinfer_runtime.engine.prefix_cache import PrefixCache
from deepinfer_runtime.engine.request import Request
from deepinfer_runtime.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer_runtime.engine.spec_decode import SpecDecoder
from deepinfer_runtime.kv_pool import KVPools
from deepinfer_runtime.model_loader import load_model
from deepinfer_runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_runtime.sampler import Sampler, child_seed, derive_request_seed
from deepinfer_runtime.sampling_params import SamplingParams
from deepinfer_runtime.slot_pool import SlotPool
from deepinfer_runtime.tokenizer import Tokenizer

_DEFAULT_CPU_KV_BYTES = 2 << 30


def default_model_dir(arch: str = "v4.1") -> Path:
    """The built-in tiny random checkpoint (real tokenizer), written once under $DEEPINFER_CACHE."""
    from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

    root = Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))
    path = root / f"tiny-{arch}-flash-fp8-fp4-seed0"
    if not (path / "config.json").exists():
        print(
            f"[deepinfer] no model given: building a tiny random DeepSeek-{arch.upper()}-Flash checkpoint at {path}",
            file=sys.stderr,
        )
        tmp = path.with_suffix(".tmp")
        write_tiny_checkpoint(tmp, arch, "fp8+fp4", seed=0)
        tmp.rename(path)
    else:
        print(f"[deepinfer] no model given: using the tiny random checkpoint at {path}", file=sys.stderr)
    return path


class LLM:
    """An offline engine over one model.

    Args:
        model: checkpoint directory (config.json, safetensors, tokenizer.json); None = built-in tiny V4.1.
        dtype: "auto" (bfloat16 on GPU, float32 on CPU), "float32", "bfloat16".
        device: "cpu", "cuda", ... (default: cuda when available).
        max_num_seqs: cap on running requests per step.
        max_num_batched_tokens: token budget per step (chunked prefill mixes with decodes under it).
        max_model_len: longest prompt + output (default: min(model limit, 32768)).
        gpu_memory_utilization / kv_cache_memory: the KV budget as a fraction of device memory, or bytes.
        enable_prefix_caching: share the KV of common prompt prefixes between requests (chained block
            hashes, LRU eviction; a hit recomputes at least the model's bounded replay: 1 token, or the
            YOCO keep length K for V4.1 with truncation). Exact: a hit gives the values of a recompute.
        seed: derives the sampling stream of requests that set no seed of their own.
        block_size: tokens per KV block; a multiple of every compression ratio (default: the smallest
            such multiple of 16, e.g. 128 for the released V4 / V4.1 schedules).
        yoco_mode / yoco_keep_tokens / fake_quant / engram_device: V4.1 model options (see ``load_model``;
            ``engram_device="cuda"`` keeps the Engram tables in device memory; the default on a GPU, pinned host
            memory, is read in place by the device, so decode steps are captured in CUDA graphs either way).
        batch_invariant: a request's logits are bitwise the same whatever else is in the batch and however
            its prompt is chunked (None: ``DEEPINFER_BATCH_INVARIANT``). Only row-invariant backends serve
            this mode; the CPU references always are, so on the CPU it costs nothing.
        async_scheduling: plan and launch step N+1 while the device still runs step N (default: on for CUDA,
            off on the CPU, where host and device are the same cores). Outputs are identical either way.
        enforce_eager: True: no CUDA graphs. False (on CUDA): decode steps of at most ``cuda_graph_max_tokens``
            requests replay CUDA graphs of the whole step, and other steps of at most that many tokens their FFN
            sublayers (``cuda_graphs``; bitwise the eager results). None (default): False, except on the ranks
            of a parallel run (whose MoE layers communicate), which stay eager.
        speculative_config: speculative decoding, vLLM's dict shape: ``{"method": "dspark",
            "num_speculative_tokens": 5}`` (V4.1's DSpark head, or V4-Flash-0731's DSpark stages, loaded only then),
            ``{"method": "mtp", "num_speculative_tokens": 1}``
            (V4-Flash's MTP layer, loaded only then), ``{"method": "ngram", ...}`` (prompt lookup,
            any model); keys ``verification`` ("rejection" | "block"), ``varlen``, ``verify_budget``,
            ``confidence_temperature`` (see ``deepinfer_spec.SpeculativeConfig``). None: DeepInfer's
            ``DEEPINFER_USE_NEXTN_DECODE`` (off when unset or 0). Runs synchronously (async scheduling off).
        data_parallel_size / expert_parallel_size / context_parallel_size: > 1 spawns one process per rank
            (gloo on the CPU, NCCL with one GPU per rank; this process only drives them): attention data
            parallel over ``data_parallel_size`` ranks, their MoE layers expert parallel (EP = DP, the default,
            or 1), long prefills split over CP groups of ``context_parallel_size`` ranks. See
            ``deepinfer_runtime.distributed``. Greedy outputs equal the single-process engine's.
        context_parallel_min_tokens: prompts at least this long are prefilled with CP (default 2048).
        enable_eplb / eplb_window_size / eplb_step_interval / num_redundant_experts: expert-parallel load
            balancing (live rearrangement every ``eplb_step_interval`` steps from the loads of the last
            ``eplb_window_size``; None: ``DEEPINFER_EPLB_*``, else 1000 / 3000 / 0 redundant slots per layer).
        load_shard: internal (set by the ranks of a multi-process engine): load only this rank's part of the
            checkpoint (``deepinfer_runtime.loader.shard.LoadShard``).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        block_size: int | None = None,
        yoco_mode: str | None = None,
        yoco_keep_tokens: int | None = None,
        fake_quant: bool = True,
        engram_device: str | None = None,
        batch_invariant: bool | None = None,
        log_stats: bool = True,
        async_scheduling: bool | None = None,
        enforce_eager: bool | None = None,
        cuda_graph_max_tokens: int = 64,
        speculative_config: dict | None = None,
        data_parallel_size: int = 1,
        expert_parallel_size: int | None = None,
        context_parallel_size: int = 1,
        context_parallel_min_tokens: int | None = None,
        enable_eplb: bool = False,
        eplb_window_size: int | None = None,
        eplb_step_interval: int | None = None,
        num_redundant_experts: int | None = None,
        load_shard=None,
    ):
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("block_size", 1 if block_size is None else block_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if gpu_memory_utilization is not None and kv_cache_memory is not None:
            raise ValueError("give gpu_memory_utilization or kv_cache_memory, not both")
        if batch_invariant is not None:
            from deepinfer_kernels import registry

            registry.set_batch_invariant(batch_invariant)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype == "auto":
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        path = Path(model) if model is not None else default_model_dir()
        self.model_path = path
        self.seed, self.enable_prefix_caching = seed, enable_prefix_caching
        self._next_request = 0
        self.spec: SpecDecoder | None = None
        from deepinfer_runtime.distributed.config import ParallelConfig

        self.parallel = ParallelConfig.create(
            data_parallel_size,
            expert_parallel_size,
            context_parallel_size,
            device_type=self.device.type,
            enable_eplb=enable_eplb,
            eplb_window_size=eplb_window_size,
            eplb_step_interval=eplb_step_interval,
            num_redundant_experts=num_redundant_experts,
            cp_min_tokens=context_parallel_min_tokens,
        )
        if self.parallel.enabled:  # the ranks build the engine below; this process only drives them
            if speculative_config is not None:
                raise ValueError("speculative_config with data/context parallelism is not supported yet")
            from deepinfer_runtime.distributed.driver import start_parallel

            rank_kwargs = dict(
                dtype=dtype,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory=kv_cache_memory,
                enable_prefix_caching=enable_prefix_caching,
                seed=seed,
                block_size=block_size,
                yoco_mode=yoco_mode,
                yoco_keep_tokens=yoco_keep_tokens,
                fake_quant=fake_quant,
                engram_device=engram_device,
                batch_invariant=batch_invariant,
                log_stats=log_stats,
                async_scheduling=async_scheduling,
            )
            start_parallel(self, path, rank_kwargs, self.parallel)
            return
        from deepinfer_spec import SpeculativeConfig

        spec_config = SpeculativeConfig.from_engine_arg(speculative_config)
        arch_opts: dict[str, Any] = {}
        if _architecture(path) == "DeepseekV41ForCausalLM":
            arch_opts = dict(
                yoco_mode=yoco_mode,
                yoco_keep_tokens=yoco_keep_tokens,
                fake_quant=fake_quant,
                engram_device=engram_device,
            )
        if spec_config is not None and spec_config.method == "mtp":
            arch_opts["mtp"] = True  # V4's MTP layer is loaded only to draft with it
        if (
            spec_config is not None
            and spec_config.method == "dspark"
            and _architecture(path) == "DeepseekV4ForCausalLM"
        ):
            arch_opts["dspark"] = True  # likewise V4-Flash-0731's DSpark stages (V4.1 always loads its own)
        self.model = load_model(path, dtype=dtype, device=self.device, shard=load_shard, **arch_opts)
        if enforce_eager is None:
            enforce_eager = load_shard is not None
        if not enforce_eager and self.device.type == "cuda":
            self.model.enable_cuda_graphs(cuda_graph_max_tokens)
        self.tokenizer = Tokenizer(path)
        cfg = self.model.cfg
        limit = min(cfg.max_position_embeddings, 32768)
        self.max_model_len = max_model_len or limit
        if not 1 < self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in (1, {cfg.max_position_embeddings}], got {max_model_len}")
        block_size = _block_size(block_size, self.model.growing_ratios())
        budget_bytes = self._kv_budget(gpu_memory_utilization, kv_cache_memory)
        snapshots = max_num_seqs if enable_prefix_caching else 0
        self.spec = self._spec_decoder(spec_config, max_num_batched_tokens)
        backtrack = 0 if self.spec is None else self.spec.backtrack
        layout = self.model.cache_layout(backtrack)
        self.budget = CacheBudget(layout, budget_bytes, max_num_seqs, block_size, snapshots)
        if log_stats:
            print(f"[deepinfer] KV cache accounting ({self.model.dtype}):\n{self.budget.summary()}", file=sys.stderr)
        blocks = BlockAllocator(self.budget.num_blocks, block_size)
        self.prefix_cache = (
            PrefixCache(blocks, snapshots, self.model.prefix_replay_tokens()) if enable_prefix_caching else None
        )
        sched = Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, self.max_model_len), blocks, self.prefix_cache
        )
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
        self.eos = {int(e) for e in eos if e is not None}
        pools = KVPools(blocks.num_blocks, block_size, self.device)
        slots = SlotPool(self.model.slot_specs(backtrack), max_num_seqs, snapshots, self.device)
        if async_scheduling is None:  # drafts need each step's tokens: speculative decoding runs synchronously
            async_scheduling = self.device.type == "cuda" and self.spec is None
        self.engine = LLMEngine(
            sched,
            ModelRunner(self.model, Sampler(self.eos), self.device, pools, slots, self.spec),
            self.tokenizer,
            self.eos,
            async_scheduling=bool(async_scheduling),
        )

    def _spec_decoder(self, config, max_rows: int) -> SpecDecoder | None:
        from deepinfer_runtime.engine.proposers import build_proposer

        if config is None:
            return None
        spec = SpecDecoder(
            config,
            build_proposer(self.model, config),
            self.model.cfg.vocab_size,
            self.max_model_len,
            max_rows,
            self.device,
        )
        yoco = getattr(self.model, "yoco_mode", "off")
        window = self.model.cfg.sliding_window
        if yoco != "off" and self.model.yoco_keep < window + spec.backtrack:
            raise ValueError(
                f"yoco_keep_tokens = {self.model.yoco_keep} must be >= sliding window {window} + backtracking "
                f"{spec.backtrack} (num_speculative_tokens + 1) with speculative decoding (decisions Y2, Y6)"
            )
        return spec

    def _kv_budget(self, utilization: float | None, explicit: int | None) -> int:
        if explicit is not None:
            if not isinstance(explicit, int) or explicit <= 0:
                raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {explicit!r}")
            return explicit
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free - (1 - (utilization or 0.9)) * total)
        return _DEFAULT_CPU_KV_BYTES

    def shutdown(self) -> None:
        """Stop the rank processes of a multi-process engine (no-op for a single process). Idempotent."""
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()

    # --- requests ----------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_bos=True) if prompt else []
        return None, [int(t) for t in prompt]

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> str | None:
        """Why this request cannot run (None when it can)."""
        if not ids:
            return "empty prompt"
        vocab = self.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {vocab})"
        image = getattr(self.model.cfg, "image_token_id", None)
        if image is not None and image in ids:
            return f"prompt contains image tokens (id {image}): this model has no vision tower loaded"
        if len(ids) >= self.max_model_len:
            return f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}"
        if params.prompt_logprobs is not None and getattr(self.model, "yoco_mode", "off") != "off":
            return (
                "prompt_logprobs needs yoco_mode='off': YOCO prefill truncation skips the decoder layers on "
                "all but the last prompt rows (DeepInfer switches prompt logprobs off there too)"
            )
        need = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if need > self.budget.num_tokens:
            return f"prompt + max_tokens needs {need} tokens of KV cache; the budget holds {self.budget.num_tokens}"
        return None

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. A prompt that cannot run (empty, too long, ...) gets
        an output with ``error`` set and ``finish_reason == "error"``; the others run normally."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        groups: dict[int, list[Request]] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] is a {type(sp).__name__}, not SamplingParams")
            text, ids = self._prompt_ids(prompt)
            rid = str(self._next_request)
            base_seed = sp.seed if sp.seed is not None else derive_request_seed(self.seed, self._next_request)
            self._next_request += 1
            problem = self._check_prompt(ids, sp)
            if problem is not None:
                print(f"[deepinfer] request {rid} rejected: {problem}", file=sys.stderr)
                outputs[i] = RequestOutput(
                    rid, text, ids, [CompletionOutput(0, "", [], None, None, "error")], error=problem
                )
                continue
            groups[i] = []
            for k in range(sp.n):
                req = Request(f"{rid}" if sp.n == 1 else f"{rid}-{k}", text, ids, sp, child_seed(base_seed, k))
                groups[i].append(req)
                self.engine.add_request(req)
        total = sum(len(g) for g in groups.values())
        start = time.perf_counter()
        bar = tqdm(total=total, desc="generating", unit="req", disable=not use_tqdm, leave=False)
        done = 0
        while self.engine.has_unfinished:
            finished = self.engine.step()
            done += len(finished)
            bar.update(len(finished))
        bar.close()
        elapsed = time.perf_counter() - start
        for i, reqs in groups.items():
            outputs[i] = _to_output(reqs, self.spec)
        if use_tqdm and total:
            n_in = sum(r.num_prompt_tokens for g in groups.values() for r in g)
            n_out = sum(len(r.output_token_ids) for g in groups.values() for r in g)
            print(
                f"[deepinfer] {total} requests in {elapsed:.2f} s: {n_in / elapsed:,.1f} input tok/s, "
                f"{n_out / elapsed:,.1f} output tok/s, {self.engine.num_steps} engine steps so far",
                file=sys.stderr,
            )
            if self.spec is not None:
                print(f"[deepinfer] {self.spec.summary()}", file=sys.stderr)
        return outputs

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        thinking: bool | None = None,
        reasoning_effort: str | int | None = None,
        use_tqdm: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> list[RequestOutput]:
        """Chat completions with the model's own chat encoding (DeepSeek V4 / V4.1, thinking modes)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ids = [
            self.tokenizer.encode_chat(conv, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools)
            for conv in conversations
        ]
        return self.generate(ids, sampling_params, use_tqdm=use_tqdm)


def _block_size(requested: int | None, ratios: set[int]) -> int:
    """The engine block size: whole compressor groups per block (pool rows are block_size // ratio)."""
    multiple = math.lcm(*ratios) if ratios else 1
    if requested is None:
        return multiple * -(-16 // multiple)
    if requested % multiple:
        raise ValueError(
            f"block_size must be a multiple of every compression ratio {sorted(ratios)} "
            f"(so, of {multiple}); got {requested}"
        )
    return requested


def _architecture(path: Path) -> str | None:
    import json

    try:
        return (json.loads((path / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError):
        return None  # load_model reports the problem with the right error


def _to_output(reqs: list[Request], spec: SpecDecoder | None = None) -> RequestOutput:
    first = reqs[0]
    completions = []
    for k, r in enumerate(reqs):
        completions.append(
            CompletionOutput(
                index=k,
                text=r.output_text,
                token_ids=list(r.output_token_ids),
                cumulative_logprob=r.cumulative_logprob if r.params.logprobs is not None else None,
                logprobs=r.logprobs if r.params.logprobs is not None else None,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
            )
        )
    ttft = None if first.first_token_time is None else first.first_token_time - first.arrival_time
    decode = None
    if first.finish_time is not None and first.first_token_time is not None and len(first.output_token_ids) > 1:
        span = first.finish_time - first.first_token_time
        decode = (len(first.output_token_ids) - 1) / span if span > 0 else None
    metrics = RequestMetrics(
        first.arrival_time,
        first.first_token_time,
        first.finish_time,
        ttft,
        decode,
        first.num_cached_tokens,
        sum(r.num_preemptions for r in reqs),
        None if spec is None else spec.stats.pop_request(first.request_id),
    )
    if spec is not None:
        for r in reqs[1:]:
            spec.stats.pop_request(r.request_id)
    request_id = first.request_id.rsplit("-", 1)[0] if len(reqs) > 1 else first.request_id
    error = next((r.error for r in reqs if r.error is not None), None)  # engine-side failure (e.g. bad grammar)
    return RequestOutput(
        request_id,
        first.prompt,
        first.prompt_token_ids,
        completions,
        True,
        metrics,
        first.num_cached_tokens,
        error,
        first.prompt_logprobs,
    )
