"""The interpreter harness: a case that fails on NumPy's refusal of int() of a 1-element array (Triton 3.6 under
NumPy >= 2.4) skips with the reason; any other failure still fails."""

import pytest
from deepinfer_kernels.testing import triton_interpreter as ti


def _run_with(monkeypatch, result: str):
    monkeypatch.setattr(ti, "run_interpreted_cases", lambda path, cases: {"a": result})
    return ti.interpreted_cases_test(__file__, {"a": ("f", ())})


def test_numpy_refusal_skips(monkeypatch):
    test = _run_with(monkeypatch, f"Traceback ...\nTypeError('{ti.NUMPY_REFUSAL}')")
    with pytest.raises(pytest.skip.Exception, match="triton-lang/triton#9171"):
        test("a")


def test_other_failures_fail_and_passes_pass(monkeypatch):
    with pytest.raises(AssertionError, match="boom"):
        _run_with(monkeypatch, "AssertionError: boom")("a")
    _run_with(monkeypatch, "")("a")
