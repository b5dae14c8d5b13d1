"""One shared spawned gloo group of 4 ranks for the distributed tests (starting ranks costs seconds each); tests at
world 2 run on a sub-group of its last 2 ranks. ``ranks(world, fn, *args)`` returns those ``world`` results.
The group is shut down as soon as the next test is outside this directory (it does not idle through other
packages' tests)."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # spawned ranks import parallel_workers from here

_SHARED: dict = {}


@pytest.fixture
def _group4():
    import parallel_workers as W
    from deepinfer_parallel import WorkerGroup

    group = _SHARED.get("group4")
    if group is None or group.closed:  # first use, or a failed test took the group down
        group = WorkerGroup(4, backend="gloo", call_timeout_s=60, collective_timeout_s=60)
        group.call(W.make_subgroups, [2])
        _SHARED["group4"] = group
    return group


@pytest.fixture
def ranks(_group4):
    def run(world, fn, *args):
        outs = _group4.call(fn, world, *args)
        first = len(outs) - world
        assert all(o is None for o in outs[:first])
        return outs[first:]

    return run


def pytest_runtest_teardown(item, nextitem):
    if "group4" in _SHARED and (nextitem is None or Path(nextitem.path).parent != HERE):
        _SHARED.pop("group4").shutdown()
