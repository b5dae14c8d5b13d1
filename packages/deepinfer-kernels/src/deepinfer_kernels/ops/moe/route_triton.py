"""Triton routers (CUDA backend ``triton`` of ``moe_route_topk`` and ``moe_route_hash``): one launch for the whole
router.

The reference is a chain of small kernels per MoE layer (scores, bias add, topk, gather, sum, divide, scale): at
decode they are a few dozen of a step's launches. Here one program owns one token's row of E logits (E <= 1024:
256 for V4-Flash, 384 for V4.1-Flash) and picks its k experts by k rounds of (max, lowest index at the max),
in descending biased score as the reference's sorted topk, with ties going to the lower expert id (the
reference leaves ties to torch.topk). The weights are the scores at the picks, normalised by their sum and scaled:
the fp32 operations of the reference (softplus through an accurate log1p), so the scores agree to an ulp or so
and the weights to a few. A NaN score ranks first, as in torch.topk. A program reads only its own row:
batch-invariant.

Hash routing (V4 layers 0-2) is the same chain with a table lookup in place of the topk (index, gather, scores,
gather, sum, divide, scale: about 13 kernels per layer per step). Its program reads the token's id and the k table
entries, then only the k logits they pick (sqrtsoftplus and sigmoid score a logit alone, in one warp; softmax still
reduces the row to its max and sum, then scores the k picks with the same operations as the top-k kernel scores
every expert). The scorings are one ``_score`` for both kernels. The range checks are the reference's
(``check_hash_ranges``): with ``check_ranges=False`` nothing synchronises and the launch is CUDA-graph safe; ids or
entries out of range then give unspecified weights and experts, but never an access outside the tensors.
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._elementwise import SOFTPLUS_THRESHOLD
from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

from .reference import check_hash_ranges, moe_route_hash_ref, moe_route_topk_ref

_SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
MAX_EXPERTS = 1024  # a row in one program: the top-k router, and the hash router's softmax
# Warps of the top-k router (``bench_moe_route.py`` sweeps it). One warp would make its 3k reductions shuffles
# without CTA barriers and reads the same alone (H200, session 23), but costs 4-10 us a MoE layer in a decode step,
# likely because there the router shares its SM with weight-stream programs and one warp gets a small share of the
# issue slots; 8 warps are no faster than 4.
ROUTE_WARPS = 4


@triton.jit
def _log1p(y):
    """log(1 + y) for y >= 0 to a couple of ulp (Goldberg's trick: the rounding of 1 + y cancels), where
    log(1 + y) alone loses every digit of a small y (router logits of -20 would all score 0 and tie)."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * tl.math.div_rn(y, u - 1.0))


@triton.jit
def _softmax_stats(x, ok):
    """The max of a row's logits x at ``ok`` and the sum of exp(x - max) there: what ``_score``'s softmax needs."""
    row_max = tl.max(tl.where(ok, x, float("-inf")), axis=0)
    return row_max, tl.sum(tl.where(ok, tl.exp(x - row_max), 0.0), axis=0)


@triton.jit
def _score(x, row_max, row_sum, threshold, SCORING: tl.constexpr):
    """The fp32 scores of logits x: sqrt(softplus) (0), sigmoid (1) or softmax (2, given ``_softmax_stats`` of the
    row; the max and sum are ignored by the others)."""
    if SCORING == 0:
        s = tl.sqrt(tl.where(x > threshold, x, _log1p(tl.exp(x))))
    elif SCORING == 1:
        s = tl.math.div_rn(1.0, 1.0 + tl.exp(-x))
    else:
        s = tl.math.div_rn(tl.exp(x - row_max), row_sum)
    return s


@triton.jit
def _store_route(
    w_ptr, e_ptr, t, slot, weights, experts, route_scale, norm_eps, TOP_K: tl.constexpr, NORM: tl.constexpr
):
    """Both routers' tail: token t's k weights (scores at its experts; zero past TOP_K) normalised by their sum +
    norm_eps with an IEEE division as the reference's (Triton's fp32 ``/`` is the approximate div.full on the GPU),
    scaled, and stored with the experts in slots [0, TOP_K)."""
    if NORM:
        weights = tl.math.div_rn(weights, tl.sum(weights, axis=0) + norm_eps)
    keep = slot < TOP_K
    tl.store(w_ptr + t * TOP_K + slot, weights * route_scale, mask=keep)
    tl.store(e_ptr + t * TOP_K + slot, experts, mask=keep)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, w_ptr, e_ptr, E, L_ST, route_scale, norm_eps, threshold,
    TOP_K: tl.constexpr, KP: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    ok = cols < E
    x = tl.load(logits_ptr + t * L_ST + cols, mask=ok, other=0.0).to(tl.float32)
    if SCORING == 2:
        row_max, row_sum = _softmax_stats(x, ok)
    else:
        row_max, row_sum = 0.0, 1.0
    s = _score(x, row_max, row_sum, threshold, SCORING)  # past E: never picked
    sel = s
    if HAS_BIAS:
        sel = s + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    sel = tl.where(sel != sel, float("inf"), sel)  # NaN ranks above everything, as in torch.topk
    free = ok
    slot = tl.arange(0, KP)
    weights = tl.zeros([KP], tl.float32)
    experts = tl.zeros([KP], tl.int64)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, sel, float("-inf")), axis=0)
        pick = tl.min(tl.where(free & (sel == best), cols, BLOCK_E), axis=0)
        weights = tl.where(slot == i, tl.sum(tl.where(cols == pick, s, 0.0), axis=0), weights)
        experts = tl.where(slot == i, pick.to(tl.int64), experts)
        free = free & (cols != pick)
    _store_route(w_ptr, e_ptr, t, slot, weights, experts, route_scale, norm_eps, TOP_K, NORM)


@triton.jit
def _hash_route_kernel(
    logits_ptr, table_ptr, ids_ptr, w_ptr, e_ptr, E, V, L_ST, TAB_ST0, TAB_ST1, IDS_ST, route_scale, norm_eps,
    threshold, TOP_K: tl.constexpr, KP: tl.constexpr, SCORING: tl.constexpr, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, KP)
    keep = slot < TOP_K
    tok = tl.load(ids_ptr + t * IDS_ST).to(tl.int64)
    row_ok = (tok >= 0) & (tok < V)  # unchecked ids out of range read nothing
    experts = tl.load(table_ptr + tok * TAB_ST0 + slot * TAB_ST1, mask=keep & row_ok, other=-1).to(tl.int64)
    hit = keep & (experts >= 0) & (experts < E)
    x = tl.load(logits_ptr + t * L_ST + experts, mask=hit, other=0.0).to(tl.float32)
    if SCORING == 2:
        cols = tl.arange(0, BLOCK_E)
        ok = cols < E
        row = tl.load(logits_ptr + t * L_ST + cols, mask=ok, other=0.0).to(tl.float32)
        row_max, row_sum = _softmax_stats(row, ok)
    else:
        row_max, row_sum = 0.0, 1.0
    weights = tl.where(keep, _score(x, row_max, row_sum, threshold, SCORING), 0.0)
    _store_route(w_ptr, e_ptr, t, slot, weights, experts, route_scale, norm_eps, TOP_K, NORM)


def moe_route_topk_triton(logits, bias, top_k, *, route_scale, scoring="sqrtsoftplus", norm_topk=True, norm_eps=1e-20):
    t, e = logits.shape
    if e > MAX_EXPERTS:  # one program holds a row
        return moe_route_topk_ref(
            logits, bias, top_k, route_scale=route_scale, scoring=scoring, norm_topk=norm_topk, norm_eps=norm_eps
        )
    require_same_device(logits, *([bias] if bias is not None else []))
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    bias = bias.contiguous() if bias is not None else None
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t and top_k:
        _route_kernel[(t,)](
            logits, bias if bias is not None else logits, weights, experts, e, logits.stride(0), float(route_scale),
            float(norm_eps), SOFTPLUS_THRESHOLD, TOP_K=top_k, KP=triton.next_power_of_2(top_k),
            SCORING=_SCORING[scoring], HAS_BIAS=bias is not None, NORM=norm_topk,
            BLOCK_E=triton.next_power_of_2(e), num_warps=ROUTE_WARPS, **pdl_options(logits.device),
        )  # fmt: skip
    return weights, experts


def moe_route_hash_triton(
    logits, tid2eid, input_ids, *, route_scale, scoring="sqrtsoftplus", norm_topk=True, norm_eps=1e-20,
    check_ranges=True,
):  # fmt: skip
    t, e = logits.shape
    if scoring == "softmax" and e > MAX_EXPERTS:  # the softmax's row in one program
        return moe_route_hash_ref(
            logits, tid2eid, input_ids, route_scale=route_scale, scoring=scoring, norm_topk=norm_topk,
            norm_eps=norm_eps, check_ranges=check_ranges,
        )  # fmt: skip
    require_same_device(logits, tid2eid, input_ids)
    check_hash_ranges(logits, tid2eid, input_ids, check_ranges)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    top_k = tid2eid.shape[1]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t and top_k:
        _hash_route_kernel[(t,)](
            logits, tid2eid, input_ids, weights, experts, e, tid2eid.shape[0], logits.stride(0), tid2eid.stride(0),
            tid2eid.stride(1), input_ids.stride(0), float(route_scale), float(norm_eps), SOFTPLUS_THRESHOLD,
            TOP_K=top_k, KP=triton.next_power_of_2(top_k), SCORING=_SCORING[scoring], NORM=norm_topk,
            BLOCK_E=triton.next_power_of_2(e) if scoring == "softmax" else 1,
            num_warps=4 if scoring == "softmax" else 1, **pdl_options(logits.device),
        )  # fmt: skip
    return weights, experts


register_backend(
    "moe_route_topk", "triton", moe_route_topk_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip


register_backend(
    "moe_route_hash", "triton", moe_route_hash_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip
