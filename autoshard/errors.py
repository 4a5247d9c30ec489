"""One error family for user mistakes (docs/design.md, "Errors").

Messages state the contract, then "got ...", then the fix. Internal invariants use ``assert``.
"""
from __future__ import annotations


class AutoshardError(ValueError):
    """A user-facing error: what was expected, what was got, how to fix it."""

    def __init__(self, expected: str, *, got: str, fix: str) -> None:
        self.expected, self.got, self.fix = expected, got, fix
        super().__init__(f"{expected}; got {got}. Fix: {fix}")
