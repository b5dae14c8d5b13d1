"""Launcher: workers start, answer, and a dead / hung / failing rank (or a dead driver) ends the group with a clear
error and no process left behind."""

import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import parallel_workers as W
import pytest
from deepinfer_parallel import ParallelError, WorkerGroup


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie is dead, only not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


_DRIVER = textwrap.dedent(
    """
    import os, sys
    from deepinfer_parallel import WorkerGroup
    g = WorkerGroup(1, backend="gloo")
    print(" ".join(map(str, g.pids)), flush=True)
    os.kill(os.getpid(), 9)  # the driver dies without any cleanup
    """
)


@pytest.fixture(scope="module")
def fresh():
    """Groups that the tests below break, started concurrently (start-up is the expensive part), plus a driver
    process that SIGKILLs itself after starting a worker."""
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, text=True)
    with ThreadPoolExecutor(3) as pool:
        kill = pool.submit(WorkerGroup, 2, backend="gloo", call_timeout_s=60, collective_timeout_s=60)
        hang = pool.submit(WorkerGroup, 1, backend="gloo", call_timeout_s=60, collective_timeout_s=60)
        fail = pool.submit(WorkerGroup, 1, backend="gloo")
        groups = {"kill": kill.result(), "hang": hang.result(), "fail": fail.result(), "driver": driver}
    yield groups
    for name in ("kill", "hang", "fail"):
        groups[name].shutdown()
    driver.kill()


def test_call_returns_per_rank_results(_group4):
    outs = _group4.call(W.whoami)
    assert [(r, w) for r, w, _ in outs] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [pid for _, _, pid in outs] == _group4.pids
    assert _group4.call(W.raise_on, -1) == [0, 1, 2, 3]
    # per-rank arguments: each rank gets its own tuple
    assert _group4.call(W.barrier_after_sleep, rank_args=[(9, 0.0)] * 4) == [0, 1, 2, 3]


def test_killed_rank_raises_within_bound_and_leaves_no_orphans(fresh):
    group = fresh["kill"]
    pids = group.pids
    # rank 1 sleeps before a barrier in which rank 0 waits; the test SIGKILLs rank 1 from outside
    threading.Timer(1.0, os.kill, args=(pids[1], 9)).start()
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match=r"rank 1 died with exit code -9 \(SIGKILL\) while running") as err:
        group.call(W.barrier_after_sleep, 1, 30.0)
    elapsed = time.monotonic() - t0
    print(f"\nkilled rank reported after {elapsed:.2f} s: {err.value}")
    assert elapsed < 20
    assert not any(_alive(p) for p in pids)  # reaped before the error was raised
    with pytest.raises(ParallelError, match="shut down"):
        group.call(W.whoami)


def test_hung_rank_times_out(fresh):
    group = fresh["hang"]
    pids = group.pids
    t0 = time.monotonic()
    expected = r"rank 0 did not finish running 'barrier_after_sleep' within 2 s \(hung\?\)"
    with pytest.raises(ParallelError, match=expected):
        group.call(W.barrier_after_sleep, 0, 60.0, timeout_s=2.0)
    assert time.monotonic() - t0 < 10
    assert not any(_alive(p) for p in pids)


def test_worker_exception_is_reported(fresh):
    group = fresh["fail"]
    pids = group.pids
    with pytest.raises(ParallelError, match=r"(?s)rank 0 raised while running 'raise_on'.*boom from a worker"):
        group.call(W.raise_on, 0)
    assert not any(_alive(p) for p in pids)


def test_workers_die_with_their_driver(fresh):
    driver = fresh["driver"]
    line = driver.stdout.readline()
    driver.wait(timeout=60)
    pids = [int(p) for p in line.split()]
    assert len(pids) == 1, f"driver did not start its workers: {line!r}"
    assert driver.returncode == -9
    assert _wait_gone(pids, 10.0), f"workers {pids} outlived their driver"


def test_start_up_failure_is_reported():
    with pytest.raises(ValueError, match="backend"):
        WorkerGroup(1, backend="mpi")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([str(Path(__file__))]))
