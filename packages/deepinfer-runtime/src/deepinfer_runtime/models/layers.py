"""Weight holders shared by the DeepSeek V4 and V4.1 models: parameters live under the checkpoint's
names, and every matrix product goes through the row-invariant ``deepinfer_kernels.linear``.

Quantised storage (``quantize_weights_``): a ``Linear`` can keep its weight as FP8 e4m3 with one UE8M0 scale
per block x block tile (V4: 128x128, V4.1 MXFP8: 32x32) and then runs ``act_quant_fp8`` + ``fp8_gemm_nt``;
``Experts`` can keep MXFP4 stacks (``Mxfp4Experts``), which ``moe_experts`` runs with the MXFP4 grouped-GEMM
ops. Code that reads ``.weight`` / ``.w13`` directly keeps working (a Linear's ``.weight`` is then the
dequantised matrix, made on each access)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from deepinfer_kernels import (
    Fp8Activations,
    MhcConfig,
    MhcParams,
    Mxfp4Experts,
    fp8_block_dequantize,
    fp8_block_quantize,
    fp8_gemm_activations,
    gather_rows,
    linear,
    linear_many,
    mhc_coefficients,
    mhc_collapse_rms_norm,
    mhc_expand,
    mhc_expand_collapse,
    moe_experts,
    quantize_fp8_activations,
    rms_norm,
    rms_norm_rope,
    rope_interleaved,
    sparse_mqa_attention,
    swiglu_clamp,
    swiglu_mlp,
)
from torch import nn

from deepinfer_runtime.models.side_stream import SideStream


def param(*shape: int, dtype: torch.dtype, device: str | None = None) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)


_DEFER_EXPERTS = [False]


@contextmanager
def deferred_experts() -> Iterator[None]:
    """Models built inside get ``Experts`` stacks on the meta device (no memory) until ``Experts.allocate_``:
    a rank that loads only its expert slots never holds (nor zeroes) the whole model's experts."""
    _DEFER_EXPERTS[0] = True
    try:
        yield
    finally:
        _DEFER_EXPERTS[0] = False


class Linear(nn.Module):
    """Holds ``weight`` [out, in] under the checkpoint's name; y = x W^T in x's dtype, row-invariant.

    After ``quantize_fp8_(block)`` it holds ``qweight`` (FP8 e4m3) and ``scale`` (UE8M0 per block x block) and
    computes y = fp8_gemm_nt(act_quant_fp8(x, block), W): activations quantised per 1 x block, fp32 accumulation
    (``quantize_fp8_activations`` / ``fp8_gemm_activations``: at prefill sizes the same numbers in bf16).
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.block: int | None = None
        self.weight = param(out_features, in_features, dtype=dtype)

    @property
    def weight(self) -> torch.Tensor:
        w = self._parameters.get("weight")
        if w is not None:
            return w
        if self.block is None:
            raise AttributeError("weight")
        return fp8_block_dequantize(self.qweight, self.scale, (self.block, self.block), out_dtype=self.dtype)

    def quantize_fp8_(self, block: int) -> None:
        """Keep the weight as FP8 with one UE8M0 scale per block x block tile (K must be a multiple of block)."""
        w = self._parameters["weight"]
        if w.shape[1] % block:
            raise ValueError(f"Linear.quantize_fp8_: in_features {w.shape[1]} is not a multiple of block {block}")
        q, scale = fp8_block_quantize(w.data, (block, block), scale_fmt="ue8m0")
        del self._parameters["weight"]
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.block, self.dtype = block, w.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block is None:
            return linear(x, self.weight)
        return self.from_quantized(x, self.quantize_input(x))

    def quantize_input(self, x: torch.Tensor) -> Fp8Activations:
        """An FP8 Linear's activation quantisation of x [..., in] per 1 x block with UE8M0 scales, in the form its
        GEMM reads (``quantize_fp8_activations``: e4m3 + scales, or at prefill sizes the same numbers in bf16);
        FP8 Linears of one block size reading the same x can share it (``project``)."""
        return quantize_fp8_activations(x.reshape(-1, x.shape[-1]), self.block)

    def from_quantized(self, x: torch.Tensor, quantized: Fp8Activations) -> torch.Tensor:
        """This FP8 Linear of x from ``quantize_input(x)``: [..., out] in x's dtype."""
        y = fp8_gemm_activations(quantized, self.qweight, self.scale, out_dtype=x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])


def project(x: torch.Tensor, linears: list[Linear], out_dtypes: list[torch.dtype | None]) -> list[torch.Tensor]:
    """x [..., K] through several ``Linear`` of the same input, each ``linear(x, weight, out_dtype)`` (None: x's
    dtype; FP8 Linears asked for x's dtype run their own GEMM, those of one block size on one quantisation of x):
    the plain weights in one ``linear_many`` call, which at decode sizes streams them all in one launch."""
    plain = [i for i, (m, dt) in enumerate(zip(linears, out_dtypes)) if m.block is None or dt is not None]
    outs: list[torch.Tensor | None] = [None] * len(linears)
    quantized: dict[int, Fp8Activations] = {}  # block -> the quantised x
    for i, m in enumerate(linears):
        if i not in plain:
            if m.block not in quantized:
                quantized[m.block] = m.quantize_input(x)
            outs[i] = m.from_quantized(x, quantized[m.block])
    if plain:
        for i, y in zip(plain, linear_many(x, [linears[i].weight for i in plain], [out_dtypes[i] for i in plain])):
            outs[i] = y
    return outs  # type: ignore[return-value]


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = param(dim, dtype=torch.float32)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    @property
    def fused(self) -> tuple[torch.Tensor, float]:
        """(weight, eps): the ``norm`` argument of the mHC sublayer ops, which make this norm of a site's collapse
        in the collapse's kernel (``mhc_collapse_rms_norm``)."""
        return self.weight, self.eps

    def collapse(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This norm of ``mhc_collapse(x, weights)`` in one op (the same bits for bf16 streams): [T, n, d] -> [T, d]."""
        return mhc_collapse_rms_norm(x, weights, self.weight, self.eps)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, **into) -> torch.Tensor:
        """RoPE on the trailing channels of this norm's output, in one op: bitwise ``rope_interleaved(self(x),
        positions, inv_freq)``; a new tensor, or rows of a table with ``into`` = out / out_rows (``rms_norm_rope``)."""
        return rms_norm_rope(x, self.weight, self.eps, positions, inv_freq, **into)


def embed_streams(weight: torch.Tensor, ids: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """Token ids [T] -> the residual streams [T, hc_mult, d]: each token's embedding row in every stream, made by
    one gather (``gather_rows`` with ``copies``) rather than a gather and an expanding copy."""
    return gather_rows(weight, ids, hc_mult)


def cat_rows(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=0)


def draft_block_inputs(anchor: int, cache, block_size: int, noise_token_id: int, embed: torch.Tensor, hc_mult: int):
    """One request's DSpark draft block: positions [N] a .. a + N - 1 (a = ``cache.seq_len``, where the cache's
    DSpark context must end), token ids [N] int64 = [anchor, noise x (N - 1)] and their streams [N, hc_mult, d]."""
    a = cache.seq_len
    if cache.ctx_end != a:
        raise ValueError(f"DSpark context ends at {cache.ctx_end}, anchor position is {a}")
    pos = torch.arange(a, a + block_size, device=embed.device)
    ids = torch.full((block_size,), noise_token_id, dtype=torch.long, device=embed.device)
    ids[0] = anchor
    return pos, ids, embed_streams(embed, ids, hc_mult)


def draft_block_key_ids(window: int, num_ctx: int, block: int, device: torch.device) -> torch.Tensor:
    """Key ids [window + block] shared by every row of a non-causal draft block (DSpark) whose keys are
    [num_ctx context rows (num_ctx <= window) | block rows]: the context rows right-aligned in the first
    ``window`` slots (-1 before them), then all block rows. One fixed width W + N whatever the context length."""
    ctx_ids = torch.arange(window, device=device) - (window - num_ctx)
    return torch.cat([ctx_ids.clamp(min=-1), num_ctx + torch.arange(block, device=device)])


class Experts(nn.Module):
    """Routed experts stacked per layer: ``w13`` [E, 2I, d] (gate rows then up rows) and ``w2`` [E, d, I].

    After ``quantize_mxfp4_()`` they are ``Mxfp4Experts`` (buffers ``w13_packed`` / ``w13_scale`` / ``w2_*``),
    which ``moe_experts`` runs with the MXFP4 grouped-GEMM ops. The MoE layers call the module (not
    ``moe_experts`` directly) so that expert parallelism can swap in a module with the same call that holds
    only this rank's experts (``deepinfer_runtime.distributed``)."""

    def __init__(self, n_experts: int, inter: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        device = "meta" if _DEFER_EXPERTS[0] else None
        self.w13 = param(n_experts, 2 * inter, hidden, dtype=dtype, device=device)
        self.w2 = param(n_experts, hidden, inter, dtype=dtype, device=device)
        # logical expert held by each stack entry when a loader filled only a rank's slots (None: entry e = expert e)
        self.slot_experts: tuple[int, ...] | None = None

    def allocate_(self, slot_experts: list[int] | None = None) -> None:
        """Allocate zeroed stacks (after a ``deferred_experts`` build): one entry per logical expert, or with
        ``slot_experts`` one per slot of a rank (entry s will hold logical expert ``slot_experts[s]``)."""
        _, two_inter, hidden = self.w13.shape
        n = self.w13.shape[0] if slot_experts is None else len(slot_experts)
        self.w13 = param(n, two_inter, hidden, dtype=self.w13.dtype)
        self.w2 = param(n, hidden, two_inter // 2, dtype=self.w2.dtype)
        self.slot_experts = None if slot_experts is None else tuple(slot_experts)

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *, swiglu_limit: float | None
    ) -> torch.Tensor:
        """x [T, d], experts [T, k] int64 logical ids, weights [T, k] fp32 -> [T, d] in x.dtype."""
        return moe_experts(x, experts, weights, self.w13, self.w2, swiglu_limit=swiglu_limit)

    def _weights(self, name: str):
        w = self._parameters.get(name)
        if w is not None:
            return w
        if f"{name}_packed" in self._buffers:
            return Mxfp4Experts(self._buffers[f"{name}_packed"], self._buffers[f"{name}_scale"])
        raise AttributeError(name)

    w13 = property(lambda self: self._weights("w13"))
    w2 = property(lambda self: self._weights("w2"))

    @property
    def quantized(self) -> bool:
        return "w13_packed" in self._buffers

    def quantize_mxfp4_(self) -> None:
        """Keep both stacks as MXFP4 (E2M1 + one UE8M0 scale per 32 along K), one expert at a time."""
        for name in ("w13", "w2"):
            q = Mxfp4Experts.quantize(self._parameters[name].data)
            del self._parameters[name]
            self.register_buffer(f"{name}_packed", q.packed)
            self.register_buffer(f"{name}_scale", q.scale)


# Linears the models read through ``.weight`` (grouped / fp32 products): quantising them would only add a
# dequantisation per call, so ``quantize_weights_`` leaves them in the model dtype. (The shared experts are
# quantised as a whole, ``SharedExpert.quantize_fp8_``, not Linear by Linear.)
READ_AS_WEIGHT = ("shared_experts.", ".wo_a", "compressor.", "head", "mtp.", "main_proj")
# Whether ``quantize_weights_`` keeps the backbone's shared experts in FP8 (their released format: MXFP8 in V4.1,
# 128-block FP8 in V4, run as the released model runs them) rather than in the model dtype. Off: not faster with
# today's FP8 kernels. H100, V4.1 slice, one round against the same tree without it (session 38,
# ``ab_split_sum_shared_fp8_gemv_h100_session38.log``): batch 1 +24 us, 8 -6, 64 +1, 256 +326 us (the Triton FP8
# GEMM at 256 rows against cuBLAS bf16), 8K prefill 85.2 -> 86.0 ms (two more activation quantisations). At one row
# its gate/up GEMV (23.6 MB) takes 16 us cold, ~48% of copy, where the bf16 one reads twice the bytes in about 20.
QUANTIZE_SHARED_EXPERTS = False


def quantize_weights_(
    model: nn.Module, dense_block: int | None, experts: bool, skip: tuple[str, ...] = READ_AS_WEIGHT
) -> dict[str, int]:
    """Quantise a model in place: every ``Linear`` whose name contains none of ``skip`` to FP8 with
    ``dense_block`` x ``dense_block`` UE8M0 scales (None: leave dense weights), the backbone's shared experts
    likewise (``SharedExpert.quantize_fp8_``, with QUANTIZE_SHARED_EXPERTS; three Linears each in the count), and
    with ``experts`` every ``Experts`` to MXFP4. Returns counts {"linear": n, "experts": m}."""
    done = {"linear": 0, "experts": 0}
    for name, m in list(model.named_modules()):
        if isinstance(m, Experts) and experts and not m.quantized:
            m.quantize_mxfp4_()
            done["experts"] += 1
        elif isinstance(m, SharedExpert) and dense_block is not None and QUANTIZE_SHARED_EXPERTS and not m.quantized:
            if "mtp." in name:  # the DSpark / MTP stages keep their weights in the model dtype (READ_AS_WEIGHT)
                continue
            m.quantize_fp8_(dense_block)
            done["linear"] += 3
        elif isinstance(m, Linear) and dense_block is not None and m.block is None:
            if any(s in name for s in skip) or m.weight.shape[1] % dense_block:
                continue
            m.quantize_fp8_(dense_block)
            done["linear"] += 1
    return done


class SharedExpert(nn.Module):
    """The shared expert's SwiGLU MLP: w1 (gate), w3 (up) [inter, hidden] and w2 (down) [hidden, inter] under the
    checkpoint's names. ``quantize_fp8_`` (the released MXFP8 / FP8 format) replaces w1 and w3 by one FP8 Linear
    ``w13`` [2 inter, hidden] (gate rows, then up rows) and quantises w2; ``forward`` then runs the FP8 GEMMs."""

    def __init__(self, inter: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.w1, self.w3, self.w2 = (
            Linear(hidden, inter, dtype),
            Linear(hidden, inter, dtype),
            Linear(inter, hidden, dtype),
        )

    @property
    def quantized(self) -> bool:
        return "w13" in self._modules

    def quantize_fp8_(self, block: int) -> None:
        """Keep the weights as FP8 with one UE8M0 scale per block x block tile (``Linear.quantize_fp8_``; the
        intermediate size a multiple of block, so that no scale tile spans gate and up rows): gate and up stacked
        as ``w13``, which a decode step streams in one GEMM launch."""
        inter, hidden = self.w1.weight.shape
        if inter % block:
            raise ValueError(f"SharedExpert.quantize_fp8_: intermediate size {inter} is not a multiple of {block}")
        w13 = Linear(hidden, 2 * inter, self.w1.weight.dtype).to(self.w1.weight.device)
        w13.weight.data.copy_(torch.cat([self.w1.weight.data, self.w3.weight.data]))
        w13.quantize_fp8_(block)
        self.w2.quantize_fp8_(block)
        del self.w1, self.w3
        self.w13 = w13

    def forward(self, x: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] in x.dtype: w2(swiglu_clamp(w1 x, w3 x)). Quantised: gate and up from one
        FP8 GEMM in x's dtype, the clamped SwiGLU in fp32 rounded to x's dtype, the FP8 down GEMM (the released
        model's roundings: each FP8 Linear quantises its input per 1 x block)."""
        if not self.quantized:
            return swiglu_mlp(x, self.w1.weight, self.w3.weight, self.w2.weight, swiglu_limit=swiglu_limit)
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(swiglu_clamp(gate, up, swiglu_limit, x.dtype))


# The attention output's inverse RoPE made by the kernel that stores the output (``sparse_mqa_attention``'s
# ``out_rope``: the same bits, a launch fewer on each attention site's chain) instead of by a launch of its own after
# it. H200, pipelined ms at 4K tokens, two alternating rounds in one lease (``benchmarks/ab_slice.py``, session 25):
# V4 batch 1 1.098 -> 1.095, V4.1 2.316 -> 2.300 (round 2; round 1's base was an outlier), batch 8 unchanged.
FUSED_OUT_ROPE = True


def attention_rotated_back(q, kv, indices, sinks, scale, positions, inv_freq) -> torch.Tensor:
    """DeepSeek V4's attention core: ``sparse_mqa_attention`` (q [T, H, D], kv rows or two segments, indices [T, K],
    sinks [H], scale), then the inverse RoPE of each head's trailing channels at ``positions`` [T] (``inv_freq``
    [R/2]): [T, H, D] in q.dtype, what the grouped output projection reads."""
    if FUSED_OUT_ROPE:
        return sparse_mqa_attention(q, kv, indices, sinks, scale, out_rope=(positions, inv_freq))
    o = sparse_mqa_attention(q, kv, indices, sinks, scale)
    return rope_interleaved(o, positions, inv_freq, inverse=True, out=o)  # o is the attention's fresh output


# Token counts (inclusive ranges) at which a MoE sublayer with MXFP4 experts runs its shared expert in order on the
# main path, before the router, instead of on the "shared" side stream: a shared expert running beside the routed
# gate/up GEMM slows that GEMM by more than the overlap saves (session 36, batch 64: the 8-row ``mma.sync`` kernel
# 3.97 -> 4.57 ms a step over 8 layers, ``profile_step.py --timeline``; why is not understood). H100, V4.1 slice
# (``--quant fp8+fp4``, 4K, pipelined ms, same-lease rounds), inline against the side stream, us: session 36 batch 1
# -86 / -89; session 37 (x read through the sort's row index, ``moe.MXFP4_X_BY_INDEX``, which moved the overlap;
# ``ab_row_index_shared_inline_h100_session37.log``, two rounds each) batch 8 +102, 16 +141 (side stream), 32 -313,
# 64 -238, 128 -124, 256 -1159 (inline); V4 slice batch 256 -248 us against session 36's ranges. Batches 2-7 and
# 17-31 were not measured.
SHARED_INLINE_TOKENS: tuple[tuple[int, int], ...] = ((1, 1), (32, 256))


def shared_expert_inline(tokens: int, experts: nn.Module) -> bool:
    """Whether ``routed_plus_shared`` keeps the shared expert on the main path for ``tokens`` rows (see
    SHARED_INLINE_TOKENS; only with local MXFP4 experts, where it was measured: not the expert-parallel ones)."""
    quantized = getattr(experts, "quantized", False)
    return quantized and any(lo <= tokens <= hi for lo, hi in SHARED_INLINE_TOKENS)


def routed_plus_shared(
    x: torch.Tensor,
    route: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    experts: Experts,
    shared: SharedExpert,
    swiglu_limit: float | None,
    split: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A MoE sublayer: ``experts(x, *route())`` (route() -> (weights [T, k], expert ids [T, k])) plus the shared
    expert, [T, d] in x.dtype. The shared expert runs on a side stream: its weight stream overlaps the router's
    and the routed experts' latency-bound kernels (numerics unchanged), on the lane of lowest priority (lane
    "shared"), so that its programs, which fill every SM, give way to the router's. ``split``: the two addends
    (routed, shared) instead, for an mHC site whose expand adds them (``mhc_expand``'s y_add: one launch fewer,
    the same bits). At the token counts of ``shared_expert_inline`` it runs first on the main path instead."""
    side = SideStream.inline() if shared_expert_inline(x.shape[0], experts) else SideStream.of(x.device, "shared")
    with side.branch():
        y = shared(x, swiglu_limit)
    weights, ids = route()
    routed = experts(x, ids, weights, swiglu_limit=swiglu_limit)
    side.join()
    return (routed, y) if split else routed + y


class MhcBlock(nn.Module):
    """Base of a DeepSeek V4 / V4.1 block: the mHC parameters of its two sites (attention, FFN) under the
    checkpoint's names ``hc_{attn,ffn}_{fn,base,scale}`` (fp32) and the coefficient settings."""

    def __init__(self, hc_mult: int, hidden: int, norm_eps: float, hc_eps: float, sinkhorn_iters: int):
        super().__init__()
        mix = (2 + hc_mult) * hc_mult
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", param(mix, hc_mult * hidden, dtype=torch.float32))
            setattr(self, f"hc_{site}_base", param(mix, dtype=torch.float32))
            setattr(self, f"hc_{site}_scale", param(3, dtype=torch.float32))
        self.hc = MhcConfig(norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)

    def mhc(self, site: str) -> MhcParams:
        return MhcParams(
            getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"), getattr(self, f"hc_{site}_scale")
        )

    def site_beside(
        self,
        x: torch.Tensor,
        site: str,
        sublayer_input: Callable[[], torch.Tensor],
        f: Callable,
        lane: str = "layer",
        next_norm: Norm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One mHC site with its coefficients made beside the sublayer, on side lane ``lane``: (pre, post, comb) =
        ``mhc_coefficients(x)`` there, meanwhile y = f(sublayer_input()) on the current stream (an input that does
        not wait for them: V4.1's lagged collapse, V4's ``mhc_pre_collapse_rms_norm``); returns (``mhc_expand`` of
        y, or of y[0] + y[1] when f returns two addends (its y_add), pre, None). With ``next_norm`` (V4.1, where the
        next site collapses the new streams with this site's pre), the third item is that site's sublayer input,
        ``next_norm.collapse(streams, pre)``, made from the collapse the expand hands over
        (``mhc_expand_collapse``) instead of reading the streams back: the same bits for bf16 streams."""
        side = SideStream.of(x.device, lane)
        with side.branch():
            pre, post, comb = mhc_coefficients(x, self.mhc(site), self.hc)
        y = f(sublayer_input())
        side.join()
        y, y_add = y if isinstance(y, tuple) else (y, None)
        if next_norm is None:
            return mhc_expand(x, y, post, comb, y_add=y_add), pre, None
        streams, u = mhc_expand_collapse(x, y, post, comb, pre, y_add=y_add)
        return streams, pre, next_norm(u)
