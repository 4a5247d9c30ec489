"""Test tiers (docs/design.md, "Testing"): every test that runs on a multi-process gloo world is
marked ``gloo`` here, from the fixtures it uses, so that no test file has to remember to.
``slow`` is set by hand on tests that take more than about 10 s on an idle 2-core machine.

    python -m pytest -m "not slow and not gloo"     # pure data and one-process tests
    python -m pytest -m "not slow"                  # the fast tier (under 2 minutes)
    python -m pytest                                 # everything (the README's command)
"""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(name.startswith("world") for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gloo)
