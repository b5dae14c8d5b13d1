"""Run test cases under Triton's CPU interpreter in a fresh Python process.

``TRITON_INTERPRET=1`` is read when ``@triton.jit`` decorates a function (triton.language's own helpers
included), so it cannot be switched on inside a process that already imported Triton for the GPU. The
interpreted cases of a test file therefore run in one child process: the file is executed there with
``runpy`` and each case (a function of the file and plain, repr-able arguments) is called in turn.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys

# Triton 3.6's interpreter converts 1-element arrays with int(), which NumPy 2.4 and later refuse
# (triton-lang/triton#9171): every kernel with a loop over a runtime bound fails there, whatever it computes.
NUMPY_REFUSAL = "only 0-dimensional arrays can be converted to Python scalars"
NUMPY_SKIP = (
    "Triton's interpreter cannot run under this NumPy (>= 2.4 refuses int() of a 1-element array, "
    "triton-lang/triton#9171); requirements-dev.txt pins numpy<2.4 for the CPU suite"
)

_CHILD = """
import json, runpy, sys, traceback
ns = runpy.run_path({path!r})
for key, (func, args) in {cases!r}.items():
    try:
        ns[func](*args)
        res = {{"key": key, "ok": True}}
    except BaseException:
        res = {{"key": key, "ok": False, "error": traceback.format_exc()[-4000:]}}
    print("@@case " + json.dumps(res), flush=True)
"""


def triton_importable() -> bool:
    """True when the ``triton`` package can be imported (the interpreter needs no GPU)."""
    return importlib.util.find_spec("triton") is not None


def run_interpreted_cases(path: str, cases: dict[str, tuple[str, tuple]], timeout: float = 900.0) -> dict[str, str]:
    """Run ``func(*args)`` for every ``key: (func, args)`` of ``cases`` from the Python file ``path`` in one
    child process with ``TRITON_INTERPRET=1`` and no visible GPU. Returns key -> "" (passed) or the error
    text (failed, or never reached because the child died)."""
    code = _CHILD.format(path=path, cases=cases)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    if platform.machine().lower() in ("x86_64", "amd64"):
        # The interpreter's tl.dot is numpy's matmul. OpenBLAS's FMA kernels (Haswell, Zen: what it picks on AMD
        # EPYC and many other x86 CPUs) give a row different last bits at different positions in a tile, so a
        # row alone and the same row inside a batch can differ, which no GPU kernel does and the batch-invariance
        # tests would report; its AVX kernels without FMA do not (numpy's wheels ship OpenBLAS; other BLAS
        # libraries ignore the variable). A value set by the caller wins.
        env.setdefault("OPENBLAS_CORETYPE", "Sandybridge")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    results = {key: f"child exited with {proc.returncode} before this case:\n{proc.stderr[-4000:]}" for key in cases}
    for line in proc.stdout.splitlines():
        if line.startswith("@@case "):
            res = json.loads(line[len("@@case ") :])
            results[res["key"]] = "" if res["ok"] else res["error"]
    return results


def interpreted_cases_test(path: str, cases: dict[str, tuple[str, tuple]]):
    """A pytest test parametrized over ``cases`` whose cases all run once, in one interpreter child process
    (``run_interpreted_cases``), on first use. In a test file: ``test_interpreter = interpreted_cases_test(
    __file__, INTERP_CASES)``."""
    import pytest

    results: dict[str, str] = {}
    failure: list[BaseException] = []

    @pytest.mark.parametrize("case", list(cases))
    def test(case: str) -> None:
        if failure:
            raise failure[0]
        if not results:
            try:
                results.update(run_interpreted_cases(path, cases))
            except BaseException as exc:  # e.g. the child timed out: every case reports it, none reruns it
                failure.append(exc)
                raise
        if NUMPY_REFUSAL in results[case]:
            pytest.skip(NUMPY_SKIP)
        assert not results[case], results[case]

    return test
