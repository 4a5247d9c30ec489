"""The alpha-beta fit of a link: §1.1's ring formulas (docs/cost-model.md) fitted by least squares
to measured collectives, on relative residuals."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


from autoshard.cost.comm import COLLECTIVE_KINDS, collective_time
from autoshard.errors import AutoshardError
from autoshard.ir import CollectiveKind


# The collectives a plan runs (cost/reshards.py): the link figures are fitted to these. send/recv
# is measured and fitted on its own (in "measured"): no plan uses it until pipeline stages are
# searched (docs/cost-model.md §6).
PLAN_KINDS = (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
              CollectiveKind.ALL_TO_ALL)


def alpha_beta_terms(kind: str, p: int) -> tuple[float, float]:
    """``(c, d)`` such that docs/cost-model.md §1.1 prices ``kind`` over ``p`` devices as
    ``c·alpha + d·S/B``: the latency steps and the bus-bandwidth factor of the ring algorithm."""
    if kind == CollectiveKind.SEND_RECV:
        return 1.0, 1.0
    if kind not in COLLECTIVE_KINDS:
        raise AutoshardError(f"a collective among {COLLECTIVE_KINDS}", got=repr(kind),
                             fix="name one of the cost model's collectives")
    if not (isinstance(p, int) and p >= 2):
        raise AutoshardError("a collective over at least 2 devices to fit", got=f"p={p!r}",
                             fix="measure with --world 2 or more")
    frac = (p - 1) / p
    if kind == CollectiveKind.ALL_REDUCE:
        return 2.0 * (p - 1), 2.0 * frac
    return float(p - 1), frac


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """A fitted link: ``alpha`` (s per ring step) and ``bandwidth`` (bus bandwidth, bytes/s), with
    the largest relative error of the fit over its samples and their number."""

    alpha: float
    bandwidth: float
    max_rel_err: float
    samples: int
    clamped: str = ""          # which parameter hit its bound (noise, or sizes too narrow)


# Bounds keep a fit of noisy timings a valid Cluster figure (positive and finite).
MIN_ALPHA = 1e-9


MAX_BANDWIDTH = 1e15


def fit_alpha_beta(samples: Sequence[tuple[str, int, float, float]]) -> AlphaBeta:
    """Fit one ``alpha`` and one bus bandwidth ``B`` to timings of collectives.

    ``samples`` are ``(kind, p, S, seconds)``: a collective of docs/cost-model.md §1.1 over ``p``
    devices on a buffer of ``S`` bytes (§1.1's ``S``: the all-reduced tensor, the all-gather's
    output, the reduce-scatter's input, each device's all-to-all input, the message). The model
    is ``t = c·alpha + d·S/B`` with ``(c, d)`` from :func:`alpha_beta_terms`: linear in
    ``(alpha, 1/B)``. Least squares on relative residuals ``(model - t) / t``, so that small
    messages (latency) weigh as much as large ones (bandwidth); timings that follow the formula
    exactly give ``alpha`` and ``B`` back exactly. Mixing kinds fits the single link figure the
    model uses for all of them.
    """
    rows = []
    for kind, p, nbytes, t in samples:
        c, d = alpha_beta_terms(kind, p)
        if not (t > 0 and math.isfinite(t) and nbytes >= 0):
            raise AutoshardError("timings that are positive and finite, sizes >= 0",
                                 got=f"{kind} p={p} S={nbytes} t={t}",
                                 fix="drop the failed measurement")
        rows.append((c / t, d * nbytes / t))        # u·alpha + v·beta ≈ 1
    suu = sum(u * u for u, _ in rows)
    suv = sum(u * v for u, v in rows)
    svv = sum(v * v for _, v in rows)
    su, sv = sum(u for u, _ in rows), sum(v for _, v in rows)
    det = suu * svv - suv * suv
    if len(rows) < 2 or det <= 1e-12 * max(suu * svv, 1e-300):
        sizes = sorted({s for _, _, s, _ in samples})
        raise AutoshardError("timings at two or more distinct message sizes to fit alpha and B",
                             got=f"{len(rows)} sample(s)" + (f", sizes {sizes}" if rows else ""),
                             fix="measure each collective at several sizes")
    alpha, beta = (svv * su - suv * sv) / det, (suu * sv - suv * su) / det
    clamped = ""
    if alpha < MIN_ALPHA:        # no visible latency: refit the bandwidth alone
        alpha, beta, clamped = MIN_ALPHA, (sv - MIN_ALPHA * suv) / svv, "alpha"
    if beta < 1.0 / MAX_BANDWIDTH:   # no visible bandwidth term: refit the latency alone
        beta, clamped = 1.0 / MAX_BANDWIDTH, "bandwidth"
        alpha = max(MIN_ALPHA, (su - beta * suv) / suu)
    err = max(abs(u * alpha + v * beta - 1.0) for u, v in rows)
    return AlphaBeta(alpha, 1.0 / beta, err, len(rows), clamped)


def predicted_time(kind: str, p: int, nbytes: float, fit: AlphaBeta) -> float:
    """The cost model's time for one collective on a fitted link (cost/comm.py)."""
    return collective_time(kind, p, nbytes, fit.alpha, fit.bandwidth)

