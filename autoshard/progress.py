"""Progress of long planning on stderr: what runs now, and how long each part took.

Planning a large model (tracing, building the ILP, each solve, the activation checkpointing
ladder, every pipeline try) takes seconds to minutes, and a user at the command line should see
where that time goes. The planner calls :func:`step` and :func:`note` at its natural points;
both do nothing unless a caller turned progress on with :func:`enabled` (the CLI does, unless
``--quiet``), so library use stays silent and pays one attribute check per call.

Each step prints one line when it ends, with its seconds; a step with steps or notes inside also
prints its name first, once the first of those comes, so a log shows the nesting without a line
for every leaf's start. Every line starts with the seconds since progress was turned on::

    [   0.3 s] tracing llama3-8b: 3.0 s
    [   3.3 s] without activation checkpointing
    [   4.0 s]   building the ILP on mesh 8x8 (dp,tp): 0.7 s
    [   5.1 s]   solving (37 decisions): 1.1 s
    [   5.1 s]   OPTIMAL: 114.172 ms per step
    [   5.3 s] without activation checkpointing: 2.0 s

On a terminal, rich also shows the steps running now, each with a spinner and its elapsed
time (erased when they end).
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Iterator


@dataclass
class _Running:
    what: str
    t0: float
    shown: bool = False       # its name printed (something inside it printed a line)
    task: Any = None          # its row in the live display, on a terminal


class _Reporter:
    """The lines of one enabled block: a rich console on ``stream``, the clock, the steps
    running (innermost last) and, on a terminal, the live display of them."""

    def __init__(self, stream: IO[str]) -> None:
        from rich.console import Console
        # markup off: a model or file name may hold [brackets]; soft_wrap: a long line is not cut.
        # A terminal only where the stream is one (FORCE_COLOR must not put a spinner's control
        # codes into a log).
        self.console = Console(file=stream, force_terminal=_isatty(stream), highlight=False,
                               markup=False, soft_wrap=True, emoji=False)
        self.t0 = time.perf_counter()
        self.running: list[_Running] = []
        # Lines of steps that raised, held until planning goes on past them: an error that
        # ends planning is the caller's to report (the CLI's one error line), not ours too.
        self.stopped: list[tuple[int, str, float]] = []
        self.live: Any = None
        if self.console.is_terminal:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
            self.live = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False),
                                 TimeElapsedColumn(), console=self.console, transient=True)

    def _print(self, depth: int, text: str, at: float | None = None) -> None:
        stamp = (time.perf_counter() if at is None else at) - self.t0
        self.console.print(f"[{stamp:6.1f} s] " + "  " * depth + text)

    def line(self, text: str) -> None:
        """A line inside the running steps: the steps that stopped before it and the running
        steps' names first, where not yet printed."""
        for depth, what, at in self.stopped:
            self._print(depth, what, at)
        self.stopped.clear()
        for depth, r in enumerate(self.running):
            if not r.shown:
                self._print(depth, r.what, at=r.t0)
                r.shown = True
        self._print(len(self.running), text)

    def begin(self, what: str) -> None:
        r = _Running(what, time.perf_counter())
        if self.live is not None:
            if not self.running:
                self.live.start()
            r.task = self.live.add_task("  " * len(self.running) + what, total=None)
        self.running.append(r)

    def end(self, failure: str | None) -> None:
        r = self.running.pop()
        took = time.perf_counter() - r.t0
        if self.live is not None:
            self.live.remove_task(r.task)
            if not self.running:
                self.live.stop()
        if failure is None:
            self.line(f"{r.what}: {took:.1f} s")
        else:
            self.stopped.append((len(self.running), f"{r.what}: {failure} after {took:.1f} s",
                                 time.perf_counter()))

    def close(self) -> None:
        self.running.clear()
        if self.live is not None:
            self.live.stop()


_reporter: _Reporter | None = None


def is_enabled() -> bool:
    return _reporter is not None


@contextmanager
def enabled(on: bool = True, stream: IO[str] | None = None) -> Iterator[None]:
    """Progress shown inside the block on ``stream`` (default: ``sys.stderr`` as it is on
    entry), when ``on``; ``on=False`` silences it inside the block even if an outer block
    turned it on (``--quiet`` always wins)."""
    global _reporter
    outer = _reporter
    _reporter = _Reporter(stream if stream is not None else sys.stderr) if on else None
    try:
        yield
    finally:
        if _reporter is not None:
            _reporter.close()
        _reporter = outer


@contextmanager
def step(what: str) -> Iterator[None]:
    """A part of planning: a line with its seconds when it ends. One that raises (the planner
    tries things that may not fit) gets a line saying why it stopped once planning goes on past
    it; an error that ends planning is left to the caller to report."""
    rep = _reporter
    if rep is None:
        yield
        return
    rep.begin(what)
    try:
        yield
    except BaseException as e:
        rep.end(_why(e))
        raise
    rep.end(None)


def note(what: str) -> None:
    """One line at the current depth: a choice made, a figure found."""
    if _reporter is not None:
        _reporter.line(what)


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):      # no isatty, or a closed stream
        return False


def _why(e: BaseException) -> str:
    """A short reason for a step that raised: an autoshard error's "got" part, cut to fit a
    line, else the exception's class."""
    got = getattr(e, "got", None)
    if isinstance(got, str) and got:
        return "stopped (" + (got if len(got) <= 100 else got[:97] + "...") + ")"
    return f"stopped ({type(e).__name__})"
