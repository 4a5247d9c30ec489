"""A persistent multi-process torch.distributed world on this machine (gloo by default).

Used by ``autoshard verify`` and by the tests (tier 2 of docs/design.md, "Testing").

Spawning processes costs seconds on a small machine, so a :class:`World` starts N ranks once
(each calls ``init_process_group`` once) and then runs any number of module-level functions in
them::

    from autoshard.codegen.world import World, world_fixture

    world2 = world_fixture(2)                  # a module-scoped pytest fixture

    def _sum_ranks(offset):                    # module level, so it pickles by reference
        t = torch.tensor([float(torch.distributed.get_rank() + offset)])
        torch.distributed.all_reduce(t)
        return t.item()

    def test_sum(world2):
        assert world2.run(_sum_ranks, 1) == [3.0, 3.0]

``run`` returns one result per rank, in rank order. A rank's exception comes back as
:class:`RankError` carrying its traceback text. A run that does not finish within ``timeout_s``
(or whose other ranks hang for ``grace_s`` after one rank failed, e.g. in a collective the failed
rank never joined) kills the world; the next ``run`` starts a fresh one, so one failing test does
not hang or poison the others. Functions meant to check an *expected* exception should catch it
and return it, since any rank error costs a health check of the world.

Ranks are forked from a forkserver that imported torch once (``PRELOAD``), so a world starts in
about a second after the first. They run with ``OMP_NUM_THREADS=1`` and get the parent's
``sys.path`` at start, so functions in test modules (pytest's default "prepend" import mode)
pickle by reference. They do *not* see later changes to the parent's environment (they fork from
the server): pass ``env=`` to set variables on every rank.

A rank killed by a signal (a crash inside a native library, seen once as a SIGSEGV in a gloo rank
on a loaded 2-core machine) leaves its faulthandler traceback in the :class:`RankError`; ``run``
then starts a fresh world and runs the function once more, with a warning that carries the crash
report, since a deterministic fault crashes again and still fails.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

__all__ = ["RankCrash", "RankError", "World", "world_fixture"]

_HOST = "127.0.0.1"
PRELOAD = ("torch", "torch.distributed", "torch.distributed.device_mesh",
           "torch.distributed._functional_collectives",
           "torch._dynamo",   # imported lazily by the first functional collective (~1.5 s)
           "autoshard.codegen.parallelize")   # what every rank imports (~0.5 s a rank)


class RankError(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


class RankCrash(RankError):
    """A rank died from a signal (not from a Python exception); the failures hold its
    faulthandler report."""


def _context(start_method: str, preload: tuple[str, ...]) -> Any:
    """A forkserver imports torch once (~4 s) and forks every rank of every world from it; four
    spawned interpreters each importing torch take ~15 s on 2 cores."""
    if start_method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))     # no effect once the server runs
        return ctx
    return mp.get_context("spawn")


def _worker(rank: int, size: int, port: int, backend: str, pg_timeout_s: float,
            env: dict[str, str], crash_log: str, tasks: Any, results: Any) -> None:
    # A forked rank has the forkserver's environment (from its first start), not the parent's.
    os.environ.update({"MASTER_ADDR": _HOST, "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(size), "OMP_NUM_THREADS": "1", **env})
    torch.set_num_threads(1)
    log = open(crash_log, "w")                # noqa: SIM115 (open for the process's life)
    faulthandler.enable(file=log, all_threads=True)
    try:
        store = tdist.TCPStore(_HOST, port, size, is_master=False,
                               timeout=datetime.timedelta(seconds=pg_timeout_s))
        tdist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                 timeout=datetime.timedelta(seconds=pg_timeout_s))
    except BaseException:
        results.put(("err", rank, -1, traceback.format_exc()))
        return
    results.put(("ready", rank, -1, None))
    try:
        while True:
            msg = tasks.get()
            if msg is None:
                break
            task_id, payload = msg
            try:
                fn, args, kwargs = pickle.loads(payload)
                out = pickle.dumps(fn(*args, **kwargs))    # pickled here, so failures surface
                results.put(("ok", rank, task_id, out))
            except BaseException:
                results.put(("err", rank, task_id, traceback.format_exc()))
    finally:
        tdist.destroy_process_group()


def _barrier() -> None:
    tdist.barrier()


class World:
    """N persistent ranks on one host, connected by ``backend`` (gloo by default)."""

    def __init__(self, size: int, *, backend: str = "gloo", timeout_s: float = 60.0,
                 grace_s: float = 3.0, start_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, start_method: str = "forkserver",
                 preload: tuple[str, ...] = PRELOAD) -> None:
        if size < 1:
            raise ValueError(f"a world has at least one rank; got {size}")
        self.size, self.backend, self.env = size, backend, dict(env or {})
        self.start_method, self.preload = start_method, tuple(preload)
        self.timeout_s, self.grace_s, self.start_timeout_s = timeout_s, grace_s, start_timeout_s
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store: Any = None
        self._next_task = 0
        self._log_dir: str | None = None
        self.starts = 0       # how many times the ranks were (re)started; tests can watch it
        self.crashes: list[str] = []    # reports of ranks that died from a signal

    # -- life cycle -----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> World:
        if self.alive:
            return self
        self._kill()
        ctx = _context(self.start_method, self.preload)
        # The parent hosts the rendezvous store on a free port: no port race between worlds.
        self._store = tdist.TCPStore(_HOST, 0, None, True, wait_for_workers=False,
                                     timeout=datetime.timedelta(seconds=self.start_timeout_s))
        port = self._store.port
        self._log_dir = tempfile.mkdtemp(prefix="autoshard-world-")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.size)]
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"        # read by the child before torch starts
        try:
            pg_timeout = max(self.timeout_s, 60.0)
            self._procs = [ctx.Process(target=_worker, daemon=True,
                                       args=(r, self.size, port, self.backend, pg_timeout,
                                             self.env, self._crash_log(r), self._tasks[r],
                                             self._results))
                           for r in range(self.size)]
            for p in self._procs:
                p.start()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        self.starts += 1
        replies = self._collect(-1, self.start_timeout_s)
        if replies is None or any(k != "ready" for k, _ in replies.values()):
            errors = {r: v for r, (k, v) in (replies or {}).items() if k == "err"}
            self._kill()
            raise RankError(errors) if errors else TimeoutError(
                f"a world of {self.size} ranks did not start within {self.start_timeout_s} s")
        return self

    def close(self) -> None:
        """Stop the ranks cleanly (each destroys its process group), killing any that hang."""
        for q in self._tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + 10.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> World:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for q in [*self._tasks, *([self._results] if self._results is not None else [])]:
            q.cancel_join_thread()
            q.close()
        self._procs, self._tasks, self._results, self._store = [], [], None, None
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    def _crash_log(self, rank: int) -> str:
        assert self._log_dir is not None
        return os.path.join(self._log_dir, f"rank{rank}.log")

    def _death(self, rank: int) -> str:
        """Why rank ``rank`` is dead: its exit code and, for a signal, what faulthandler wrote."""
        code = self._procs[rank].exitcode
        text = f"rank {rank} died (exit code {code})"
        try:
            with open(self._crash_log(rank)) as f:
                report = f.read().strip()
        except OSError:
            report = ""
        return f"{text}\n{report}" if report else text

    # -- running --------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        A rank that dies from a signal gets one more try in a fresh world (see the module doc).
        """
        payload = pickle.dumps((fn, args, kwargs))   # fails here, not silently in a feeder thread
        try:
            return self._run(fn, payload, timeout_s)
        except RankCrash as crash:
            self.crashes.append(str(crash))
            warnings.warn(f"{getattr(fn, '__name__', fn)}: {crash}\nrunning it once more in a "
                          "fresh world", RuntimeWarning, stacklevel=2)
            return self._run(fn, payload, timeout_s)

    def _run(self, fn: Callable[..., Any], payload: bytes, timeout_s: float | None) -> list[Any]:
        self.start()
        replies = self._submit(payload, timeout_s if timeout_s is not None else self.timeout_s)
        if replies is None:
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish on every rank "
                               "in time; the world was killed (the next run starts a new one)")
        errors = {r: v for r, (k, v) in replies.items() if k == "err"}
        if errors:
            if len(replies) < self.size or not self._healthy():
                self._kill()       # the others hang in a collective the failed rank left
            raise RankError(errors)
        return [pickle.loads(replies[r][1]) for r in range(self.size)]

    def _healthy(self) -> bool:
        """Every rank answers a barrier within ``grace_s`` (after some rank raised)."""
        try:
            replies = self._submit(pickle.dumps((_barrier, (), {})), self.grace_s)
        except RankError:
            return False
        return replies is not None and all(k == "ok" for k, _ in replies.values())

    def _submit(self, payload: bytes, timeout_s: float) -> dict[int, tuple[str, Any]] | None:
        task_id = self._next_task = self._next_task + 1
        for q in self._tasks:
            q.put((task_id, payload))
        replies = self._collect(task_id, timeout_s)
        if replies is None:
            self._kill()
        return replies

    def _collect(self, task_id: int, timeout_s: float) -> dict[int, tuple[str, Any]] | None:
        """Replies by rank; after the first error, wait only ``grace_s`` for the rest.

        Returns None on a timeout or a dead rank (no error reply to show for it).
        """
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.size:
            now = time.monotonic()
            if now >= deadline:
                return replies if any(k == "err" for k, _ in replies.values()) else None
            try:
                kind, rank, tid, value = self._results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                if any(not p.is_alive() for p in self._procs):
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    errs = {r: v for r, (k, v) in replies.items() if k == "err"}
                    errs.update({r: self._death(r) for r in dead if r not in replies})
                    signalled = any((self._procs[r].exitcode or 0) < 0 for r in dead)
                    self._kill()
                    raise (RankCrash if signalled else RankError)(errs)
                continue
            if tid != task_id:
                continue           # a late reply to a task that already failed
            replies[rank] = (kind, value)
            if kind == "err":
                deadline = min(deadline, time.monotonic() + self.grace_s)
        return replies


def world_fixture(size: int, **world_kwargs: Any):
    """A module-scoped pytest fixture yielding a started :class:`World` of ``size`` ranks."""
    import pytest

    @pytest.fixture(scope="module")
    def _world():
        world = World(size, **world_kwargs).start()
        try:
            yield world
        finally:
            world.close()

    return _world
