"""benchmarks/profile_step.py's timeline record: overlapping kernels (programmatic dependent launch, side streams) get
their own time (what each adds to the span), which adds up to the union of the intervals."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
profile_step = pytest.importorskip("profile_step")


def test_sequential_overlapping_and_side_stream_kernels():
    kernels = [
        ("a", 0.0, 10.0),
        ("b", 8.0, 12.0),  # launched early (PDL): 2 us of it overlap a
        ("side", 9.0, 11.0),  # a second stream's kernel, inside a and b: adds nothing to the span
        ("a", 15.0, 20.0),  # after a 3 us idle gap
    ]
    rec = profile_step.timeline_record(kernels)
    assert rec["kernels"] == 4
    assert rec["span_us"] == 20.0
    assert rec["busy_us"] == 17.0 and rec["idle_us"] == 3.0
    assert [o["own_us"] for o in rec["order"]] == [10.0, 2.0, 0.0, 5.0]
    assert [o["us"] for o in rec["order"]] == [10.0, 4.0, 2.0, 5.0]
    assert [o["gap_us"] for o in rec["order"]] == [0.0, 0.0, 0.0, 3.0]
    fams = {f["kernel"]: (f["calls"], f["us"], f["own_us"]) for f in rec["families"]}
    assert fams == {"a": (2, 15.0, 15.0), "b": (1, 4.0, 2.0), "side": (1, 2.0, 0.0)}
    assert rec["families"][0]["kernel"] == "a"  # ranked by own time


def test_streams():
    kernels = [("a", 0.0, 10.0, 7), ("side", 2.0, 14.0, 9), ("b", 10.0, 12.0, 7), ("c", 15.0, 16.0, 7)]
    rec = profile_step.timeline_record(kernels)
    assert [o["stream"] for o in rec["order"]] == [7, 9, 7, 7]
    assert rec["streams"] == {
        "7": {"kernels": 3, "us": 13.0, "own_us": 11.0},
        "9": {"kernels": 1, "us": 12.0, "own_us": 4.0},  # 10 -> 14: past a, beside b, then alone
    }
    assert rec["busy_us"] == 15.0 and rec["idle_us"] == 1.0
    without = profile_step.timeline_record([k[:3] for k in kernels])  # no stream: the same times, no stream table
    assert without["streams"] == {} and "stream" not in without["order"][0]
    assert [o["own_us"] for o in without["order"]] == [o["own_us"] for o in rec["order"]]


def test_empty():
    rec = profile_step.timeline_record([])
    assert rec["kernels"] == 0 and rec["span_us"] == 0.0 and rec["order"] == [] and rec["streams"] == {}
