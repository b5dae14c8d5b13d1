"""Mixture-of-experts: routers (top-k with selection bias, hash), the clamped SwiGLU, routed
experts and the shared expert. Token-flat: x is [T, d].

A DeepSeek V4 / V4.1 MoE layer is::

    logits = x.float() @ gate.weight.float().T            # [T, E] fp32 (V4.1: / gate_temp)
    w, ids = moe_route_topk(logits, gate.bias, k, route_scale=1.5)   # or moe_route_hash (V4 0-2)
    out = moe_experts(x, ids, w, w13, w2, swiglu_limit=10.0) + swiglu_mlp(x, sw1, sw3, sw2, swiglu_limit=10.0)
"""

from dataclasses import dataclass

import torch

from deepinfer_kernels import registry
from deepinfer_kernels.registry import batch_invariant, dispatch

from . import reference as _reference  # noqa: F401  (registers the references)
from .reference import SCORING_FUNCS


def _check_logits(logits: torch.Tensor, what: str) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{what}: logits must be [T, E], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"{what}: logits must be floating point, got {logits.dtype}")


def _check_scoring(scoring: str, what: str) -> None:
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"{what}: unknown scoring {scoring!r}; expected one of {SCORING_FUNCS}")


def moe_route_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    route_scale: float,
    scoring: str = "sqrtsoftplus",
    norm_topk: bool = True,
    norm_eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learned top-k routing (DeepSeek noaux_tc).

    scores = score(logits) in fp32 with score = sqrt(softplus(.)) ("sqrtsoftplus", V4 / V4.1),
    sigmoid ("sigmoid") or softmax over experts ("softmax"); experts = top_k of (scores + bias)
    (the bias steers the selection only); weights = scores at the selected experts, divided by
    (their sum + norm_eps) when ``norm_topk``, then times ``route_scale``.

    Args:
        logits: [T, E] router logits (fp32 recommended; upcast here).
        bias: [E] selection bias (``gate.bias``; V4.1 image tokens: ``gate.bias_vl``) or None.
        top_k: experts per token (1 <= top_k <= E).
        route_scale: ``routed_scaling_factor`` (1.5 for V4 / V4.1).
        norm_topk: ``norm_topk_prob`` (V4.1 reference: ``norm_topk_prob and top_k > 1``).
        norm_eps: 1e-20 as transformers and V4.1; the V4 reference uses 0.

    Returns:
        (weights [T, top_k] fp32, experts [T, top_k] int64). The order of the k picks within a
        row is unspecified (the reference returns them by descending biased score).
    """
    _check_logits(logits, "moe_route_topk")
    _check_scoring(scoring, "moe_route_topk")
    num_experts = logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"moe_route_topk: top_k={top_k} must be in [1, {num_experts}]")
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(f"moe_route_topk: bias {tuple(bias.shape)} != ({num_experts},)")
    return dispatch(
        "moe_route_topk",
        logits.device,
        logits,
        bias,
        top_k,
        route_scale=route_scale,
        scoring=scoring,
        norm_topk=norm_topk,
        norm_eps=norm_eps,
    )


def moe_route_hash(
    logits: torch.Tensor,
    tid2eid: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    route_scale: float,
    scoring: str = "sqrtsoftplus",
    norm_topk: bool = True,
    norm_eps: float = 1e-20,
    check_ranges: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing (V4 layers 0-2): experts = tid2eid[input_ids]; no bias. The weights are the
    learned scores gathered at those experts, normalised and scaled exactly as ``moe_route_topk``.

    Args:
        logits: [T, E]; tid2eid: [V, k] integer table (``gate.tid2eid``); input_ids: [T] integer.
        check_ranges: read the token ids and the picked table entries back to check their ranges (a host
            synchronisation on a GPU: the queue drains and the device idles until the host catches up). False
            for callers that checked the table once and the token ids at admission (the models, under the
            engine); the checks are skipped anyway while a CUDA graph is captured.

    Returns:
        (weights [T, k] fp32, experts [T, k] int64, in table order). Token ids outside the table
        or table entries outside [0, E) raise ValueError (with ``check_ranges``).
    """
    _check_logits(logits, "moe_route_hash")
    _check_scoring(scoring, "moe_route_hash")
    if tid2eid.dim() != 2 or tid2eid.is_floating_point():
        raise ValueError(
            f"moe_route_hash: tid2eid must be an integer [V, k] table, got {tid2eid.dtype}{tuple(tid2eid.shape)}"
        )
    if input_ids.dim() != 1 or input_ids.shape[0] != logits.shape[0] or input_ids.is_floating_point():
        raise ValueError(
            f"moe_route_hash: input_ids must be integer [T] with T = {logits.shape[0]}, got "
            f"{input_ids.dtype}{tuple(input_ids.shape)}"
        )
    return dispatch(
        "moe_route_hash",
        logits.device,
        logits,
        tid2eid,
        input_ids,
        route_scale=route_scale,
        scoring=scoring,
        norm_topk=norm_topk,
        norm_eps=norm_eps,
        check_ranges=check_ranges,
    )


def swiglu_clamp(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 (no clamps when limit is None), rounded to
    ``out_dtype`` (fp32: none; a 16-bit dtype: what a down projection in that dtype reads).

    The clamp is asymmetric: the gate is only capped from above. Returns the shape of gate; gate and up may be
    the two column halves of one GEMM output (views).
    """
    if gate.shape != up.shape:
        raise ValueError(f"swiglu_clamp: gate {tuple(gate.shape)} != up {tuple(up.shape)}")
    if not out_dtype.is_floating_point:
        raise ValueError(f"swiglu_clamp: out_dtype must be a floating dtype, got {out_dtype}")
    return dispatch("swiglu_clamp", gate.device, gate, up, limit, out_dtype)


@dataclass(frozen=True)
class Mxfp4Experts:
    """Stacked routed-expert weights kept in MXFP4 (the released V4 / V4.1 expert format): ``packed``
    [E, N, K/2] int8/uint8 E2M1 codes (element 2k in the low nibble) and ``scale`` [E, N, K/32] UE8M0
    (``mxfp4_quantize`` of each expert's [N, K] matrix). Pass it to ``moe_experts`` in place of w13 / w2."""

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, kh = self.packed.shape
        return (e, n, 2 * kh)

    def dequantize(self, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, N, K] in ``out_dtype`` (exact in fp32 and bf16)."""
        from deepinfer_kernels.ops.quant import mxfp4_dequantize

        e, n, k = self.shape
        return mxfp4_dequantize(self.packed.reshape(e * n, k // 2), self.scale.reshape(e * n, k // 32), out_dtype).view(
            e, n, k
        )

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Mxfp4Experts":
        """From [E, N, K] weights (K a multiple of 32), one expert at a time."""
        from deepinfer_kernels.ops.quant import mxfp4_quantize

        e, n, k = w.shape
        packed = torch.empty(e, n, k // 2, dtype=torch.int8, device=w.device)
        scale = torch.empty(e, n, k // 32, dtype=torch.float8_e8m0fnu, device=w.device)
        for i in range(e):
            packed[i], scale[i] = mxfp4_quantize(w[i])
        return cls(packed, scale)


# MXFP4 experts take the gathered (decode) layout while there is at most one (token, slot) row per
# MXFP4_GATHER_EXPERTS_PER_ROW experts, as the dense path (``moe.triton.gather_layout``): there each row streams its
# expert's weights, so rows sharing an expert multiply the bytes. H200, V4.1-Flash, 64 tokens (384 rows over ~250
# experts), gate/up + down: gathered 5.06 ms against sorted 4.45 ms (``bench_mxfp4_grouped_gemm.py --quick``,
# session 27); 512 rows had been the bound before.
MXFP4_GATHER_EXPERTS_PER_ROW = 10


# The SwiGLU output h between the two MXFP4 expert GEMMs is bf16 where a GPU backend serves them (False: fp32
# always; a switch for A/Bs): every backend rounds its x operand to bf16, so h in bf16 is the same numbers
# without an fp32 write and a conversion copy before the down GEMM (0.3 ms a MoE layer at 8K tokens of V4.1, a
# launch per layer in decode).
MXFP4_HIDDEN_BF16 = True


# The sorted layout's gate/up GEMM reads x through the sort's row tokens (``mxfp4_grouped_gemm(row_index=)``)
# instead of a sorted copy of x (False: ``index_select`` first; a switch for A/Bs): at 8K prefill tokens of V4.1
# the copy wrote 0.5 GB a MoE layer that the TMA kernel's relabelling then read back. H100, session 37, V4.1 slice:
# 8K prefill 89.6 / 89.7 -> 86.8 / 88.1 ms; decode batch 64 -77 us (one round), batch 256 +0.96 ms until the shared
# expert went inline there (``layers.SHARED_INLINE_TOKENS``; then 14.29 against 14.50 ms), two rounds each
# (``benchmarks/baselines/ab_row_index_shared_inline_h100_session37.log``).
MXFP4_X_BY_INDEX = True


def _hidden_dtype(op: str, device: torch.device) -> torch.dtype:
    """dtype of h (above): fp32 for the reference, which keeps it exact."""
    if MXFP4_HIDDEN_BF16 and registry.resolve(op, device) is not registry.reference(op):
        return torch.bfloat16
    return torch.float32


def _moe_experts_mxfp4(x, experts, weights, w13: Mxfp4Experts, w2: Mxfp4Experts, swiglu_limit):
    """Routed experts over MXFP4 weights with the grouped-GEMM ops: gate/up with the clamped SwiGLU and the
    routing weight fused (h: ``_hidden_dtype``), down projection (fp32 out), then each token's k rows summed in slot
    order (``moe_unpermute``). Few rows (decode) use the gathered layout, more (larger batches, prefill) the sorted
    one (``moe_sort_rows``); batch-invariant mode always takes the gathered layout, so a token's rows never depend
    on the batch."""
    from deepinfer_kernels.ops.moe_permute import moe_sort_rows, moe_unpermute
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import mxfp4_grouped_gemm, mxfp4_grouped_gemm_gather

    t, k = experts.shape
    if t == 0:
        return x.new_zeros(x.shape)
    f32 = torch.float32
    if batch_invariant() or t * k * MXFP4_GATHER_EXPERTS_PER_ROW <= w13.packed.shape[0]:
        flat_e = experts.reshape(-1)
        flat_w = weights.reshape(-1).float()
        h = mxfp4_grouped_gemm_gather(  # pair p = t * k + i reads token t (no arange // k launches)
            x, w13.packed, w13.scale, flat_e, rows_per_input=k, fuse_swiglu=True, swiglu_limit=swiglu_limit,
            row_scale=flat_w, out_dtype=_hidden_dtype("mxfp4_grouped_gemm_gather", x.device),
        )  # fmt: skip
        y = mxfp4_grouped_gemm_gather(h, w2.packed, w2.scale, flat_e, out_dtype=f32)
        return moe_unpermute(y, None, t, None, out_dtype=x.dtype)
    # one sort gives the sorted rows' tokens and weights and the unpermute's inverse (at decode sizes one launch on
    # the GPU, for the argsort, gathers, searchsorted and scatter of moe_permute, weights[order] and the inverse)
    order, offsets, inverse, row_token, row_weight = moe_sort_rows(experts, weights, w13.packed.shape[0])
    by_index = dict(row_index=row_token) if MXFP4_X_BY_INDEX else {}
    h = mxfp4_grouped_gemm(
        x if by_index else x.index_select(0, row_token), w13.packed, w13.scale, offsets, **by_index,
        fuse_swiglu=True, swiglu_limit=swiglu_limit, row_scale=row_weight,
        out_dtype=_hidden_dtype("mxfp4_grouped_gemm", x.device),
    )  # fmt: skip
    y = mxfp4_grouped_gemm(h, w2.packed, w2.scale, offsets, out_dtype=f32)
    return moe_unpermute(y, order, t, None, out_dtype=x.dtype, inverse=inverse)


def moe_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """Routed experts: out[t] = sum_i (w[t,i] * swiglu_clamp(x W_g^T, x W_u^T)) W2^T of expert
    e = experts[t, i], in fp32 (routing weight applied before the down projection).

    Args:
        x: [T, d] any float dtype.
        experts: [T, k] integer expert ids in [0, E) (out of range -> ValueError from the reference).
        weights: [T, k] routing weights (fp32).
        w13: [E, 2I, d]: rows 0..I-1 = gate (``w1``), rows I..2I-1 = up (``w3``); or ``Mxfp4Experts``.
        w2: [E, d, I] down projection; or ``Mxfp4Experts`` (both or neither).
        swiglu_limit: the clamp (10.0 for V4 / V4.1) or None.

    Returns:
        [T, d] in x.dtype. Only experts that were hit are computed.

    Dense bf16 / fp32 stacks on CUDA take the Triton backend (``moe/triton.py``: ``grouped_gemm[_gather]`` with
    ``moe_permute`` / ``moe_unpermute``, no host synchronisation, no weight copies, batch-invariant). It keeps
    every product exact and the down projection's input in fp32, so it differs from the reference only in
    the order of fp32 sums (a token adds its k expert outputs in slot order, not ascending expert id); it
    does not validate expert ids (that would synchronise).

    With ``Mxfp4Experts`` weights the MXFP4 grouped-GEMM ops run instead (``mxfp4_grouped_gemm[_gather]``,
    ``moe_sort_rows`` / ``moe_unpermute``): the same function of the dequantised weights, except that a token
    sums its k expert outputs in slot order (not ascending expert id) and GPU backends round the down
    projection's input to bf16, so results agree with the dequantised path to rounding, not bitwise.
    """
    if x.dim() != 2:
        raise ValueError(f"moe_experts: x must be [T, d], got {tuple(x.shape)}")
    t, d = x.shape
    if isinstance(w13, Mxfp4Experts) or isinstance(w2, Mxfp4Experts):
        if not (isinstance(w13, Mxfp4Experts) and isinstance(w2, Mxfp4Experts)):
            raise ValueError("moe_experts: w13 and w2 must both be Mxfp4Experts or both tensors")
        e, two_i, kd = w13.shape
        if kd != d or two_i % 2 or w2.shape != (e, d, two_i // 2):
            raise ValueError(f"moe_experts: MXFP4 w13 {w13.shape} / w2 {w2.shape} do not fit d = {d}")
        if experts.dim() != 2 or experts.shape[0] != t or tuple(weights.shape) != tuple(experts.shape):
            raise ValueError(f"moe_experts: experts / weights must be [{t}, k]")
        return _moe_experts_mxfp4(x, experts, weights, w13, w2, swiglu_limit)
    if experts.dim() != 2 or experts.shape[0] != t or experts.is_floating_point():
        raise ValueError(f"moe_experts: experts must be integer [{t}, k], got {experts.dtype}{tuple(experts.shape)}")
    if tuple(weights.shape) != tuple(experts.shape):
        raise ValueError(f"moe_experts: weights {tuple(weights.shape)} != experts {tuple(experts.shape)}")
    if w13.dim() != 3 or w13.shape[2] != d or w13.shape[1] % 2:
        raise ValueError(f"moe_experts: w13 must be [E, 2I, {d}], got {tuple(w13.shape)}")
    e, two_i, _ = w13.shape
    if tuple(w2.shape) != (e, d, two_i // 2):
        raise ValueError(f"moe_experts: w2 {tuple(w2.shape)} != ({e}, {d}, {two_i // 2})")
    return dispatch("moe_experts", x.device, x, experts, weights, w13, w2, swiglu_limit=swiglu_limit)


def swiglu_mlp(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, *, swiglu_limit: float | None
) -> torch.Tensor:
    """The shared expert: swiglu_clamp(x W1^T, x W3^T, limit) W2^T in fp32 (same clamps as the
    routed experts).

    Args:
        x: [T, d]; w1, w3: [I, d] (gate, up); w2: [d, I].

    Returns:
        [T, d] in x.dtype.
    """
    if x.dim() != 2:
        raise ValueError(f"swiglu_mlp: x must be [T, d], got {tuple(x.shape)}")
    d = x.shape[1]
    if w1.dim() != 2 or w1.shape[1] != d or w3.shape != w1.shape:
        raise ValueError(f"swiglu_mlp: w1 {tuple(w1.shape)} / w3 {tuple(w3.shape)} must both be [I, {d}]")
    if tuple(w2.shape) != (d, w1.shape[0]):
        raise ValueError(f"swiglu_mlp: w2 {tuple(w2.shape)} != ({d}, {w1.shape[0]})")
    return dispatch("swiglu_mlp", x.device, x, w1, w3, w2, swiglu_limit=swiglu_limit)


from . import swiglu_linear as _swiglu_linear  # noqa: F401, E402  (registers the shared expert's GPU backend)

try:  # the GPU backends of the dense path and the router register themselves when Triton imports
    from . import route_triton as _route_triton  # noqa: F401
    from . import swiglu_triton as _swiglu_triton  # noqa: F401
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass

__all__ = [
    "SCORING_FUNCS",
    "MXFP4_GATHER_EXPERTS_PER_ROW",
    "Mxfp4Experts",
    "moe_experts",
    "moe_route_hash",
    "moe_route_topk",
    "swiglu_clamp",
    "swiglu_mlp",
]
