"""What a solve ends in when it returns no plan (solver/ilp.py ``solve``): no plan fits the
memory budget, none was found in time, none is faster than the caller's cutoff, or (asked to
stop there) the device memory binds. Re-exported by solver/ilp.py."""
from __future__ import annotations


class Infeasible(Exception):
    """No assignment fits the memory ``budget``: ``least_memory`` is the least memory any plan
    needs, exactly (``exact``) or a lower bound that already exceeds the budget. Where plans
    fit the device but none of them within the host memory (``host_budget``) too,
    ``least_host`` is the least host memory a plan that fits the device needs (else None)."""

    def __init__(self, least_memory: float, *, budget: float, exact: bool = True,
                 least_host: float | None = None, host_budget: float | None = None) -> None:
        self.least_memory, self.budget, self.exact = least_memory, budget, exact
        self.least_host, self.host_budget = least_host, host_budget
        what = "is" if exact else "is at least"
        super().__init__(f"no plan fits; the least memory per device {what} "
                         f"{least_memory:.4g} bytes" + (
                             "" if least_host is None else
                             f" within {host_budget:.4g} bytes of host memory; a plan that "
                             f"fits the device needs at least {least_host:.4g} bytes of host "
                             f"memory"))


class NoSolution(Exception):
    """The solver stopped (time limit) before it found any plan, and no plan within the memory
    budget could be built without it either: not an infeasible budget, and must not be reported
    as one. ``bound`` is the solver's best lower bound on the step time (0 if it had none)."""

    def __init__(self, time_limit_s: float, status: int, bound: float = 0.0) -> None:
        self.time_limit_s, self.status, self.bound = time_limit_s, status, bound
        super().__init__(f"the solver found no plan within {time_limit_s:g} s (status {status})")


class NoBetter(Exception):
    """No plan under the cutoff step time was found: the caller holds a plan at least as fast.
    ``proved``: none exists (the backend proved it), rather than none found in time."""

    def __init__(self, proved: bool = False) -> None:
        super().__init__("no plan faster than the cutoff" + (" exists" if proved else " found"))
        self.proved = proved


class MemoryBinds(Exception):
    """Raised by ``solve`` with ``stop_if_binds``: the problem's optimum without its
    memory-only items (``bound``, seconds: a lower bound on its step) does not fit with them, so
    the device memory binds and the whole problem is the hard MIP (solver/ilp.py ``_search``)."""

    def __init__(self, bound: float) -> None:
        super().__init__(f"the device memory binds (step at least {bound:.4g} s)")
        self.bound = bound


__all__ = ["Infeasible", "MemoryBinds", "NoBetter", "NoSolution"]
