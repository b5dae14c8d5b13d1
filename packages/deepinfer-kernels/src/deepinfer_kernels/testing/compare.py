"""Comparisons used by every op test: relative error, cosine distance, bitwise equality."""

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / max(||expected||, tiny), in float64 (a global relative error)."""
    a, e = actual.double(), expected.double()
    denom = e.norm().item()
    return (a - e).norm().item() / max(denom, 1e-300)


def cos_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """1 - 2<a,e>/(|a|^2+|e|^2) in float64: the measure DeepGEMM and FlashMLA use for low precision."""
    a, e = actual.double().flatten(), expected.double().flatten()
    denom = (a * a + e * e).sum().item()
    if denom == 0:
        return 0.0
    return 1.0 - 2.0 * (a * e).sum().item() / denom


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """Fail with the measured error when the relative error exceeds ``tol`` or shapes differ."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if not torch.isfinite(actual).all() and torch.isfinite(expected).all():
        raise AssertionError(f"{what}: non-finite values where the reference is finite")
    err = rel_err(actual, expected)
    if err > tol:
        raise AssertionError(f"{what}: relative error {err:.3e} > {tol:.1e}")


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Exact equality of values, dtype and shape (NaNs compare equal to NaNs)."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(f"{what}: {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}")
    if not torch.equal(actual, expected):
        same_nan = actual.isnan() & expected.isnan()
        diff = (actual != expected) & ~same_nan
        if diff.any():
            raise AssertionError(f"{what}: {int(diff.sum())} of {actual.numel()} elements differ")
