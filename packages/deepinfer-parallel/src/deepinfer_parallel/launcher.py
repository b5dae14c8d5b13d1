"""One process per rank, a driver that sends them commands, and a watchdog that turns a dead or hung rank into a
clear ``ParallelError`` and leaves no process behind.

Process model (chosen here): the **driver is the parent process** (the one holding ``LLM``) and is *not* a member
of the process group; ranks 0 .. N-1 are all ``spawn``-ed children. The driver broadcasts each command
(``WorkerGroup.call(fn, ...)`` runs ``fn(ctx, ...)`` on every rank) over one pipe per rank and collects the N
results; rank 0's result is the one the engine uses when all ranks return the same thing (e.g. sampled tokens).
Keeping the driver out of the collectives means it can never block inside one, so the watchdog always runs:

- a rank whose process exits (crash, OOM kill, SIGKILL) is seen at once through its process sentinel;
- a rank that does not answer a command within ``call_timeout_s`` is reported as hung;
- a rank that raises is reported with its traceback.

In each case every worker is terminated (SIGTERM, then SIGKILL after a grace period) and reaped before the error is
raised. Workers also die with the driver (a parent-pid watch thread, plus ``PR_SET_PDEATHSIG`` on Linux when the group
is created from the driver's main thread), and
collectives carry ``init_process_group(timeout=collective_timeout_s)``. Backend: "gloo" (CPU) or "nccl" (rank r
uses ``cuda:r % device_count``); the rendezvous is a ``TCPStore`` served by the driver on 127.0.0.1 (single node).
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class ParallelError(RuntimeError):
    """A rank died, hung, raised or failed to start; the worker group has been shut down."""


@dataclass
class RankContext:
    """What a worker function receives as its first argument.

    Attributes:
        rank, world_size: this rank in the default process group.
        backend: "gloo" or "nccl".
        device: torch.device("cpu") or the rank's CUDA device.
        state: per-rank dict kept between calls (weights, caches, sub-groups ...).
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    state: dict[str, Any] = field(default_factory=dict)


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    # PR_SET_PDEATHSIG fires when the *thread* that spawned us exits, so it is only armed when the driver spawned
    # from its main thread; the parent-pid watch covers every case (within 0.5 s).
    if use_pdeathsig and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    store_port: int,
    collective_timeout_s: float,
    conn: multiprocessing.connection.Connection,
    parent_pid: int,
    env: dict[str, str],
    use_pdeathsig: bool,
) -> None:
    _die_with_parent(parent_pid, use_pdeathsig)
    os.environ.update(env)
    try:
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            **({"device_id": device} if backend == "nccl" else {}),
        )
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    ctx = RankContext(rank, world_size, backend, device)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        call_id, fn, args, kwargs = msg
        try:
            result = fn(ctx, *args, **kwargs)
        except BaseException:
            conn.send((call_id, False, traceback.format_exc()))
        else:
            try:
                conn.send((call_id, True, result))
            except Exception:
                conn.send((call_id, False, f"could not send the result back:\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"died with exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"died with exit code {code}"
    return f"exited with exit code {code}"


class WorkerGroup:
    """``world_size`` worker processes in one torch.distributed group, driven from this process.

    Usage::

        with WorkerGroup(2, backend="gloo") as g:
            outs = g.call(fn, x)                      # fn(ctx, x) on every rank -> [out_rank0, out_rank1]
            outs = g.call(fn, rank_args=[(a,), (b,)])  # fn(ctx, a) on rank 0, fn(ctx, b) on rank 1

    ``fn`` must be picklable by reference (a module-level function of an importable module). Any failure raises
    ``ParallelError`` after shutting every worker down; the group cannot be used afterwards.

    Args:
        world_size: ranks (processes).
        backend: "gloo" or "nccl".
        init_timeout_s: start-up budget (spawn + import + rendezvous) for all ranks.
        call_timeout_s: default budget of one ``call`` (a rank not answering by then is "hung").
        collective_timeout_s: torch.distributed timeout of each collective inside the workers.
        env: extra environment variables for the workers.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        init_timeout_s: float = 120.0,
        call_timeout_s: float = 300.0,
        collective_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"WorkerGroup: world_size must be >= 1, got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"WorkerGroup: backend must be 'gloo' or 'nccl', got {backend!r}")
        self.world_size, self.backend = world_size, backend
        self.call_timeout_s = call_timeout_s
        self._procs: list[mp.Process] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._closed = False
        self._call_id = 0
        self._start(init_timeout_s, collective_timeout_s, env or {})

    # -- lifecycle -------------------------------------------------------------------------------------------
    def _start(self, init_timeout_s: float, collective_timeout_s: float, env: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        # the rendezvous store lives in the driver, bound to a port the OS picks and kept open (no port race)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=init_timeout_s)
        )
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    self.backend,
                    self._store.port,
                    collective_timeout_s,
                    child_conn,
                    os.getpid(),
                    env,
                    threading.current_thread() is threading.main_thread(),
                ),  # noqa: E501
                name=f"deepinfer-rank{rank}",
                daemon=False,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self._collect("start-up", init_timeout_s, expect_ready=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def closed(self) -> bool:
        """True once the group was shut down (by ``shutdown`` or after a failure)."""
        return self._closed

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._kill_all()

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Ask every worker to exit, then terminate / kill any that remain; reaps them all. Idempotent."""
        if self._closed:
            return
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._store = None
        self._closed = True

    def _fail(self, message: str) -> ParallelError:
        self._kill_all()
        return ParallelError(message + "; all workers were shut down")

    # -- commands --------------------------------------------------------------------------------------------
    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        rank_args: Sequence[tuple] | None = None,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank (or ``fn(ctx, *rank_args[r], **kwargs)`` on rank r) and
        return the per-rank results in rank order. Raises ``ParallelError`` on death, hang (no answer within
        ``timeout_s``, default ``call_timeout_s``) or an exception in any rank."""
        if self._closed:
            raise ParallelError("the worker group has been shut down")
        if rank_args is not None and len(rank_args) != self.world_size:
            raise ValueError(f"call: rank_args has {len(rank_args)} entries for {self.world_size} ranks")
        self._call_id += 1
        name = getattr(fn, "__qualname__", repr(fn))
        for rank, conn in enumerate(self._conns):
            a = tuple(rank_args[rank]) if rank_args is not None else args
            try:
                conn.send((self._call_id, fn, a, kwargs))
            except (OSError, BrokenPipeError):
                raise self._fail(
                    f"rank {rank} {_describe_exit(self._procs[rank].exitcode)} before command {name!r}"
                ) from None
        return self._collect(f"running {name!r}", timeout_s if timeout_s is not None else self.call_timeout_s)

    def _dead_rank(self, grace_s: float) -> int | None:
        """A rank whose process has exited (waiting up to ``grace_s`` for one), else None."""
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        for ready in multiprocessing.connection.wait(list(by_sentinel), timeout=grace_s):
            rank = by_sentinel[ready]
            self._procs[rank].join(0.1)
            return rank
        return None

    def _collect(self, what: str, timeout_s: float, expect_ready: bool = False) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        by_conn = {conn: r for r, conn in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(pending)
                raise self._fail(
                    f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} did not finish {what} "
                    f"within {timeout_s:g} s (hung?)"
                )
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in range(self.world_size)]
            for ready in multiprocessing.connection.wait(waitables, timeout=remaining):
                if ready in by_conn:
                    rank = by_conn[ready]
                    try:
                        msg = ready.recv()
                    except (EOFError, OSError):
                        continue  # the process sentinel reports the exit
                    if expect_ready:
                        if msg[0] != "ready":
                            raise self._fail(f"rank {rank} failed during {what}:\n{msg[1]}")
                    else:
                        _, ok, payload = msg
                        if not ok:
                            dead = self._dead_rank(grace_s=2.0)
                            if dead is not None:  # the root cause: a peer's death broke this rank's collective
                                last = payload.strip().splitlines()[-1] if payload.strip() else ""
                                raise self._fail(
                                    f"rank {dead} {_describe_exit(self._procs[dead].exitcode)} while {what} "
                                    f"(rank {rank} then failed: {last})"
                                )
                            raise self._fail(f"rank {rank} raised while {what}:\n{payload}")
                        results[rank] = payload
                    pending.discard(rank)
                else:
                    rank = by_sentinel[ready]
                    self._procs[rank].join(0.1)
                    raise self._fail(f"rank {rank} {_describe_exit(self._procs[rank].exitcode)} while {what}")
        return results
