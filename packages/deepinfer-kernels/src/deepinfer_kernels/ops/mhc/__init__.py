"""Manifold-constrained hyper-connections (mHC): coefficients, collapse, expand, and the two
block wirings (V4 same-site, V4.1 lagged single-pass).

Layout is token-flat: the residual is ``x`` [T, n, d] with n = ``hc_mult`` streams (4 for both
DeepSeek V4-Flash and V4.1-Flash). Coefficients are always fp32; collapse/expand accumulate in
fp32 and return ``x.dtype``.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the references)


@dataclass(frozen=True)
class MhcParams:
    """One mHC site's parameters (``hc_attn_*`` or ``hc_ffn_*`` in the checkpoint, all fp32).

    ``fn`` rows are [pre n | post n | comb n*n] (comb row-major: row j*n + k is the weight of
    input stream j in output stream k); columns are the stream-major flattened n*d input.
    """

    fn: torch.Tensor  # [(2+n)*n, n*d] fp32
    base: torch.Tensor  # [(2+n)*n] fp32
    scale: torch.Tensor  # [3] fp32 (pre, post, comb)


@dataclass(frozen=True)
class MhcConfig:
    """``norm_eps``: rsqrt epsilon of the flattened-stream RMSNorm (V4 1e-6, V4.1 1e-20).
    ``hc_eps``: added to ``pre``, to the softmax and inside every Sinkhorn division (1e-6).
    ``sinkhorn_iters``: 20 for both models (1 column pass + 19 row/column passes)."""

    norm_eps: float
    hc_eps: float
    sinkhorn_iters: int


def _check_streams(x: torch.Tensor, what: str) -> tuple[int, int, int]:
    if x.dim() != 3:
        raise ValueError(f"{what}: x must be [T, n, d], got {tuple(x.shape)}")
    return tuple(x.shape)  # type: ignore[return-value]


def mhc_coefficients(
    x: torch.Tensor, params: MhcParams, cfg: MhcConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token mHC mixing coefficients of one site.

    flat = x.reshape(T, n*d) in fp32; m = (flat * rsqrt(mean(flat^2) + norm_eps)) @ fn^T, split
    [m_pre n | m_post n | m_comb n*n] (``base`` likewise, ``scale`` = (s_pre, s_post, s_comb)):

    * pre = sigmoid(s_pre * m_pre + b_pre) + hc_eps
    * post = 2 * sigmoid(s_post * m_post + b_post)
    * L[j, k] = s_comb * m_comb[j*n + k] + b_comb[j*n + k]; C = softmax_k(L) + hc_eps;
      C /= (sum_j C + hc_eps) (columns); then (sinkhorn_iters - 1) times: rows (sum_k), columns.

    comb[t, j, k] is the weight of input stream j in output stream k (doubly stochastic up to the
    eps terms, not symmetric): consume it with ``mhc_expand``, which contracts the first index.

    Args:
        x: [T, n, d] residual streams, any float dtype.
        params: the site's fn [(2+n)*n, n*d], base [(2+n)*n], scale [3] (fp32).
        cfg: epsilons and Sinkhorn iteration count (>= 1).

    Returns:
        (pre [T, n], post [T, n], comb [T, n, n]), all fp32. See reference.py.
    """
    t, n, d = _check_streams(x, "mhc_coefficients")
    rows = (2 + n) * n
    if tuple(params.fn.shape) != (rows, n * d):
        raise ValueError(f"mhc_coefficients: fn {tuple(params.fn.shape)} != ({rows}, {n * d}) for x {(t, n, d)}")
    if tuple(params.base.shape) != (rows,):
        raise ValueError(f"mhc_coefficients: base {tuple(params.base.shape)} != ({rows},)")
    if tuple(params.scale.shape) != (3,):
        raise ValueError(f"mhc_coefficients: scale {tuple(params.scale.shape)} != (3,)")
    if cfg.sinkhorn_iters < 1:
        raise ValueError(f"mhc_coefficients: sinkhorn_iters must be >= 1, got {cfg.sinkhorn_iters}")
    return dispatch(
        "mhc_coefficients",
        x.device,
        x,
        params.fn,
        params.base,
        params.scale,
        cfg.norm_eps,
        cfg.hc_eps,
        cfg.sinkhorn_iters,
    )


def mhc_collapse(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """u = sum_j weights[:, j] * x[:, j], accumulated in fp32.

    Args:
        x: [T, n, d] streams; weights: [T, n] (a site's ``pre``, V4.1's ``pre_mix``, or hc_head's).

    Returns:
        [T, d] in x.dtype.
    """
    t, n, _ = _check_streams(x, "mhc_collapse")
    if tuple(weights.shape) != (t, n):
        raise ValueError(f"mhc_collapse: weights {tuple(weights.shape)} != ({t}, {n})")
    return dispatch("mhc_collapse", x.device, x, weights)


def mhc_collapse_rms_norm(
    x: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """A site's sublayer input in one op: ``rms_norm(mhc_collapse(x, weights), norm_weight, eps)``, with the same
    rounding (the collapsed row is cast to x.dtype before its statistics, as the two ops in a row do; the reference
    is that composition, the Triton backend gives its bits for bf16 streams and agrees to fp32 rounding for fp32
    ones). At decode sizes both are latency-bound one-row programs; fused, the chain loses a launch per site.

    Args:
        x: [T, n, d] streams; weights: [T, n] (as ``mhc_collapse``); norm_weight: [d] (applied in fp32);
        eps: the RMSNorm epsilon.

    Returns:
        [T, d] in x.dtype.
    """
    t, n, d = _check_streams(x, "mhc_collapse_rms_norm")
    if tuple(weights.shape) != (t, n):
        raise ValueError(f"mhc_collapse_rms_norm: weights {tuple(weights.shape)} != ({t}, {n})")
    if tuple(norm_weight.shape) != (d,):
        raise ValueError(f"mhc_collapse_rms_norm: norm_weight {tuple(norm_weight.shape)} != ({d},)")
    return dispatch("mhc_collapse_rms_norm", x.device, x, weights, norm_weight, float(eps))


def _check_expand(op: str, x, y, post, comb, y_add) -> None:
    t, n, d = _check_streams(x, op)
    if tuple(y.shape) != (t, d):
        raise ValueError(f"{op}: y {tuple(y.shape)} != ({t}, {d})")
    if tuple(post.shape) != (t, n):
        raise ValueError(f"{op}: post {tuple(post.shape)} != ({t}, {n})")
    if tuple(comb.shape) != (t, n, n):
        raise ValueError(f"{op}: comb {tuple(comb.shape)} != ({t}, {n}, {n})")
    if y_add is not None and (y_add.shape != y.shape or y_add.dtype != y.dtype):
        raise ValueError(f"{op}: y_add {y_add.dtype}{tuple(y_add.shape)} != y {y.dtype}{tuple(y.shape)}")


def mhc_expand(
    x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, y_add: torch.Tensor | None = None
) -> torch.Tensor:
    """out[:, k] = post[:, k] * y + sum_j comb[:, j, k] * x[:, j], computed in fp32.

    Note the contraction over the FIRST comb index (out = post ⊗ y + comb^T x).

    Args:
        x: [T, n, d] the site's input streams; y: [T, d] the sublayer output;
        post: [T, n]; comb: [T, n, n] (from ``mhc_coefficients`` of the same site);
        y_add: None, or [T, d] of y's dtype when the sublayer's output is the sum y + y_add in that dtype (what
            ``y + y_add`` gives, e.g. the routed and the shared experts of a MoE): added here, in the same kernel.

    Returns:
        [T, n, d] in x.dtype.
    """
    _check_expand("mhc_expand", x, y, post, comb, y_add)
    return dispatch("mhc_expand", x.device, x, y, post, comb, y_add)


def mhc_expand_collapse(
    x: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    weights: torch.Tensor,
    y_add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mhc_expand`` and the collapse of its result in one op: (out, ``mhc_collapse(out, weights)``).

    For V4.1's lagged wiring, where the next site's collapse weights (this site's ``pre``) are known before this
    site's expand: the collapse is made from the streams while they are being written, not read back (at prefill
    sizes the streams are 4x the sublayer's [T, d] traffic). The Triton backend gives the two ops' bits.

    Args:
        x, y, post, comb, y_add: as ``mhc_expand``; weights: [T, n] (as ``mhc_collapse``).

    Returns:
        (out [T, n, d], collapsed [T, d]), both in x.dtype.
    """
    t, n, _ = _check_streams(x, "mhc_expand_collapse")
    if tuple(weights.shape) != (t, n):
        raise ValueError(f"mhc_expand_collapse: weights {tuple(weights.shape)} != ({t}, {n})")
    _check_expand("mhc_expand_collapse", x, y, post, comb, y_add)
    return dispatch("mhc_expand_collapse", x.device, x, y, post, comb, weights, y_add)


def _check_pre_params(
    op: str, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
) -> tuple[int, int, int]:
    """x's (T, n, d) after checking one pre weight set (the head's, or a site's pre rows): fn [n, n*d], base [n],
    one scale."""
    t, n, d = _check_streams(x, op)
    if tuple(fn.shape) != (n, n * d):
        raise ValueError(f"{op}: fn {tuple(fn.shape)} != ({n}, {n * d})")
    if tuple(base.shape) != (n,):
        raise ValueError(f"{op}: base {tuple(base.shape)} != ({n},)")
    if scale.numel() != 1:
        raise ValueError(f"{op}: scale must have one element, got {tuple(scale.shape)}")
    return t, n, d


def mhc_head_weights(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    """V4's final ``hc_head`` collapse weights: sigmoid(m * scale + base) + hc_eps with
    m = (flat * rsqrt(mean(flat^2) + norm_eps)) @ fn^T (no post, no comb, no Sinkhorn).

    Args:
        x: [T, n, d]; fn: [n, n*d] (``hc_head_fn``); base: [n]; scale: [1] (all fp32).

    Returns:
        pre [T, n] fp32; the final hidden state is ``mhc_collapse(x, pre)``.
    """
    _check_pre_params("mhc_head_weights", x, fn, base, scale)
    return dispatch("mhc_head_weights", x.device, x, fn, base, scale.reshape(1), norm_eps, hc_eps)


def mhc_pre_collapse_rms_norm(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    eps: float,
) -> torch.Tensor:
    """A V4 site's sublayer input from its streams alone: ``rms_norm(mhc_collapse(x, pre), norm_weight, eps)`` with
    ``pre = mhc_head_weights(x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps)``. Given the site's pre rows
    (``params.fn[:n]``, ``params.base[:n]``, ``params.scale[:1]``) pre is ``mhc_coefficients``' pre, so a V4 site
    can make its sublayer input without waiting for post and comb (their Sinkhorn can run beside the sublayer, for
    the expand): at decode sizes the mixes of n rows instead of (2+n)*n, and pre, collapse and norm in one kernel.

    Args:
        x: [T, n, d] streams; fn: [n, n*d], base: [n], scale: [1] (fp32, as ``mhc_head_weights``);
        norm_weight: [d]; norm_eps, hc_eps: as ``MhcConfig``; eps: the RMSNorm epsilon.

    Returns:
        [T, d] in x.dtype. The reference is the composition; the Triton backends agree with it to fp32 rounding.
    """
    d = _check_pre_params("mhc_pre_collapse_rms_norm", x, fn, base, scale)[2]
    if tuple(norm_weight.shape) != (d,):
        raise ValueError(f"mhc_pre_collapse_rms_norm: norm_weight {tuple(norm_weight.shape)} != ({d},)")
    return dispatch(
        "mhc_pre_collapse_rms_norm", x.device, x, fn, base, scale.reshape(1), norm_weight,
        float(norm_eps), float(hc_eps), float(eps),
    )  # fmt: skip


def mhc_initial_pre_mix(num_tokens: int, hc_mult: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """V4.1's layer-0 ``pre_mix``: one-hot on stream 0, fp32 [T, n]."""
    pre_mix = torch.zeros(num_tokens, hc_mult, dtype=torch.float32, device=device)
    pre_mix[:, 0] = 1.0
    return pre_mix


def _sublayer_input(x: torch.Tensor, weights: torch.Tensor, norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    return mhc_collapse(x, weights) if norm is None else mhc_collapse_rms_norm(x, weights, *norm)


def _expand_output(x, y, post, comb) -> torch.Tensor:
    """``mhc_expand`` of a sublayer output y, or of y[0] + y[1] for a pair (see ``mhc_expand``'s y_add)."""
    if isinstance(y, tuple):
        return mhc_expand(x, y[0], post, comb, y_add=y[1])
    return mhc_expand(x, y, post, comb)


def mhc_same_site_sublayer(
    x: torch.Tensor,
    f: Callable[[torch.Tensor], torch.Tensor],
    params: MhcParams,
    cfg: MhcConfig,
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """One V4 sublayer (attention or MoE) wrapped by its own mHC site (spec A.2):

    (pre, post, comb) = coefficients(x); y = f(collapse(x, pre)); return expand(x, y, post, comb).
    ``f`` maps [T, d] -> [T, d] and includes the sublayer's own RMSNorm, unless ``norm`` = (weight [d], eps)
    gives it: f then receives rms_norm(collapse(x, pre)), made by ``mhc_collapse_rms_norm``. f may return a pair
    (y, y_add) for y + y_add, which the expand adds (``mhc_expand``'s y_add). A V4 block is two calls, attention
    then MoE, each with its own params.
    """
    pre, post, comb = mhc_coefficients(x, params, cfg)
    return _expand_output(x, f(_sublayer_input(x, pre, norm)), post, comb)


def mhc_lagged_layer(
    x: torch.Tensor,
    pre_mix: torch.Tensor,
    f_attn: Callable[[torch.Tensor], torch.Tensor],
    f_ffn: Callable[[torch.Tensor], torch.Tensor],
    attn_params: MhcParams,
    ffn_params: MhcParams,
    cfg: MhcConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One V4.1 block with single-pass mHC (spec B.2): each site's ``pre`` feeds the NEXT site.

    1. (p_a, q_a, C_a) = coefficients(x; attn_params)
    2. y = f_attn(collapse(x, pre_mix));            x1 = expand(x, y, q_a, C_a)
    3. (p_f, q_f, C_f) = coefficients(x1; ffn_params)
    4. y' = f_ffn(collapse(x1, p_a));               x2 = expand(x1, y', q_f, C_f)
    5. return (x2, p_f)   (p_f is the next layer's pre_mix; after the last layer the final hidden
       state is collapse(x, pre_mix) - V4.1 has no hc_head)

    Args:
        x: [T, n, d]; pre_mix: [T, n] fp32 from the previous layer (``mhc_initial_pre_mix`` for
            layer 0); f_attn / f_ffn: [T, d] -> [T, d], each including its RMSNorm.

    Returns:
        (x_out [T, n, d] in x.dtype, pre_mix_out [T, n] fp32).
    """
    x1, p_a = mhc_lagged_site(x, pre_mix, f_attn, attn_params, cfg)
    return mhc_lagged_site(x1, p_a, f_ffn, ffn_params, cfg)


def mhc_lagged_site(
    x: torch.Tensor,
    pre_mix: torch.Tensor,
    f: Callable[[torch.Tensor], torch.Tensor],
    params: MhcParams,
    cfg: MhcConfig,
    norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One site of ``mhc_lagged_layer``: (p, q, C) = coefficients(x; params); y = f(collapse(x, pre_mix));
    returns (expand(x, y, q, C), p): the streams and the pre the NEXT site collapses with. ``norm`` and a pair
    from f as in ``mhc_same_site_sublayer``."""
    p, q, c = mhc_coefficients(x, params, cfg)
    return _expand_output(x, f(_sublayer_input(x, pre_mix, norm)), q, c), p


try:  # the Triton backends register themselves on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass

__all__ = [
    "MhcConfig",
    "MhcParams",
    "mhc_coefficients",
    "mhc_collapse",
    "mhc_collapse_rms_norm",
    "mhc_expand",
    "mhc_expand_collapse",
    "mhc_head_weights",
    "mhc_initial_pre_mix",
    "mhc_lagged_layer",
    "mhc_lagged_site",
    "mhc_pre_collapse_rms_norm",
    "mhc_same_site_sublayer",
]
