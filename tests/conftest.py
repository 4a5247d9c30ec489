"""Test tiers (docs/design.md, "Testing"): every test that runs on a multi-process gloo world is
marked ``gloo`` here, from the fixtures it uses, so that no test file has to remember to.
``slow`` is set by hand on tests that are slow by nature, and here on every test listed in
``tests/slow.txt``: the ones measured over the fast tier's per-test share. ``full`` is set on the
tests ``tests/extended.txt`` lists (measured over the README command's per-test share) and on
the cases a test file names in its ``FULL_ONLY``: they run only with ``AUTOSHARD_SLOW=1``.
``tests/tiers.py`` writes both lists from a ``--durations=0`` run.

    python -m pytest -m "not slow and not gloo"     # pure data and one-process tests
    python -m pytest -m "not slow"                  # the fast tier (under 2 minutes)
    python -m pytest                                 # the README's command (under 8 minutes)
    AUTOSHARD_SLOW=1 python -m pytest -m full        # the extended tier: the rest (CI runs it)
    AUTOSHARD_SLOW=1 python -m pytest                # all of it, the larger fuzz and sweeps too
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# One intra-op thread per pytest process, as every gloo rank has (codegen/world.py), unless
# OMP_NUM_THREADS says otherwise: the tests' tensors are tiny, and with two workers and their
# ranks on two cores a second thread only waits on the others' (gpt2-tiny's AdamW step took
# 0.24 s on torch's default two threads there, 3 ms on one; an sdpa kernel ~15 ms, 300x its
# work). Subprocesses the tests start inherit the setting.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Graphs of zoo models are reused between tests (autoshard/trace/export.py); the benchmark
# scripts, which some tests import, would otherwise turn that off for the whole session.
os.environ.setdefault("AUTOSHARD_TRACE_REUSE", "1")

HERE = Path(__file__).parent


def listed(name: str) -> set[str]:
    """The test ids a list in tests/ holds (comments and blank lines skipped)."""
    path = HERE / name
    if not path.exists():
        return set()
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow, extended = listed("slow.txt"), listed("extended.txt")
    full = bool(os.environ.get("AUTOSHARD_SLOW"))
    kept, dropped = [], []
    for item in items:
        if any(name.startswith("world") for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gloo)
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
        # A module's FULL_ONLY names the cases of its parametrized tests that repeat what
        # another case already covers (the same layout on the other tiny model, a schedule
        # the 4-rank tests run too); tests/extended.txt the tests measured too long for the
        # README's command. They run with AUTOSHARD_SLOW=1, keeping that command under 8
        # minutes on 2 cores.
        if item.nodeid in extended or \
                item.name in getattr(getattr(item, "module", None), "FULL_ONLY", ()):
            item.add_marker(pytest.mark.full)
            item.add_marker(pytest.mark.slow)
            if not full:
                dropped.append(item)
                continue
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
