"""benchmarks/ab_slice.py: variant parsing and the per-(model, context, batch) summary against the first variant."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_slice  # noqa: E402


def test_parse_variant():
    assert ab_slice.parse_variant("base") == ("base", [])
    assert ab_slice.parse_variant("s4; a.b.C=4 ;a.b.D=(1, 2)") == ("s4", ["a.b.C=4", "a.b.D=(1, 2)"])
    for bad in ("", ";a.b.C=1", "a.b.C=1"):
        with pytest.raises(ValueError, match="expected NAME"):
            ab_slice.parse_variant(bad)


def test_summary_means_and_deltas():
    def run(v, rnd, ms, batch=1):
        return {"variant": v, "round": rnd, "model": "v4", "context": 4096, "batch": batch, "ms": ms}

    runs = [run("a", 1, 1.10), run("b", 1, 1.08), run("a", 2, 1.12), run("b", 2, 1.06), run("a", 1, 2.0, batch=8)]
    rows = {(s["batch"], s["variant"]): s for s in ab_slice.summarize(runs)}
    assert rows[(1, "a")]["mean_ms"] == pytest.approx(1.11) and rows[(1, "a")]["delta_us"] == pytest.approx(0.0)
    assert rows[(1, "b")]["mean_ms"] == pytest.approx(1.07) and rows[(1, "b")]["delta_us"] == pytest.approx(-40.0)
    assert (8, "b") not in rows and rows[(8, "a")]["delta_us"] == pytest.approx(0.0)


def test_decode_rows_reads_the_slice_json():
    result = {
        "ceilings": {"copy_GBps": 4000.0},
        "v4_ours": {"decode": [{"batch": 1, "context": 4096, "pipelined_ms": 1.2, "ratio_pipelined_as_run": 1.25}]},
    }
    (row,) = ab_slice.decode_rows(result)
    assert row["model"] == "v4" and row["ms"] == 1.2 and row["x_floor"] == 1.25 and row["copy_GBps"] == 4000.0
