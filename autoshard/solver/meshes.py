"""Mesh search: which (pipeline, data, tensor) mesh to cut ``gpus`` devices into.

``autoshard plan MODEL --gpus N [--gpus-per-node G]`` does not take a mesh: it searches the
factorizations of N into a pipeline axis ``pp`` (outermost: its stages talk least, by
point-to-point sends), a data axis ``dp`` and a tensor axis ``tp`` (innermost, kept inside a
node: tp divides G), and plans each with the same planner and cost model as any other mesh.
The rules of the candidates (docs/cost-model.md §11):

- tp divides the devices of a node; pp is at most the model's repeated layers (a stage holds
  at least one); dp divides the batch (every data-parallel rank gets whole sequences);
- each candidate with a pipeline is planned at one microbatch count, the first of 4p, 2p, p
  that cuts the batch into microbatches the data axis divides (4p keeps 1F1B's bubble, (p-1)/m,
  under a fifth); the chosen mesh is then planned at the others too (``microbatches="auto"``).

Planning one candidate of GPT-3 175B takes seconds (tracing is shared: trace/batches.py), and
1024 devices have ~27 candidates, more than a time budget of ~100 s plans; so the search starts
local (Alpa prunes its stage-mesh search for the same reason): from the layout Megatron-LM's
rule of thumb gives (tensor across the node, then the fewest pipeline stages whose model state
fits half the memory) it moves to the fastest neighbour (pp or tp doubled or halved) while one
is faster; then it plans the other candidates, nearest the best first, while the budget lasts
(all of them for a model that plans fast). Every candidate, planned or not, is a try of the
search "meshes" in the plan's record of its searches (``plan.solver["searches"]``, one record
per round) with its predicted step, why it has no plan, or none of either when the time budget
left it unplanned; ``plan.solver["mesh_search"]`` keeps the search's own figures (devices,
candidates, seconds, time budget). ``autoshard show`` prints them.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from autoshard import progress
from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh, split_axes
from autoshard.options import PlanOptions, resolve_options
from autoshard.plans import Plan
from autoshard.solver.search import Try, plan_facts, records_searches, run_search
from autoshard.solver.solve import model_dims, splits_some
from autoshard.trace.batches import Traces

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True, slots=True)
class Candidate:
    pp: int
    dp: int
    tp: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh without its axes of one device (a 1-axis mesh when only one is left)."""
        return tuple(n for _, n in split_axes(zip(AXES, (self.pp, self.dp, self.tp))))

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for a, _ in split_axes(zip(AXES, (self.pp, self.dp, self.tp))))

    def __str__(self) -> str:
        return f"pp{self.pp} x dp{self.dp} x tp{self.tp}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(gpus: int, gpus_per_node: int, batch: int, layers: int) -> list[Candidate]:
    """Every (pp, dp, tp) with pp * dp * tp = gpus that the rules above allow."""
    return [Candidate(pp, gpus // (tp * pp), tp)
            for tp in divisors(gpus_per_node) if gpus % tp == 0
            for pp in divisors(gpus // tp) if pp <= max(layers, 1)
            if batch % (gpus // (tp * pp)) == 0]


def microbatches_for(c: Candidate, batch: int) -> int | None:
    """The microbatch count a candidate is screened at (None: no pipeline; 0: none fits)."""
    if c.pp == 1:
        return None
    for m in (4 * c.pp, 2 * c.pp, c.pp):
        if batch % m == 0 and (batch // m) % c.dp == 0:
            return m
    return 0


def start(cands: list[Candidate], params: int, state_bytes_per_param: float,
          memory_bytes: float) -> Candidate:
    """Megatron-LM's rule of thumb: the widest tensor axis, then the fewest pipeline stages
    whose parameters, gradients and optimizer state (``state_bytes_per_param`` each, 16 for
    mixed-precision Adam) fit half the device's memory, the rest left to activations."""
    tp = max(c.tp for c in cands)
    wide = sorted((c for c in cands if c.tp == tp), key=lambda c: c.pp)
    for c in wide:
        if params * state_bytes_per_param / (c.tp * c.pp) <= memory_bytes / 2:
            return c
    return wide[-1]


def neighbours(c: Candidate, cands: list[Candidate]) -> list[Candidate]:
    """Candidates one doubling or halving of pp or of tp away (dp takes up the rest)."""
    near = {(c.pp * 2, c.tp), (c.pp // 2, c.tp), (c.pp, c.tp * 2), (c.pp, c.tp // 2)}
    return [x for x in cands if (x.pp, x.tp) in near and x != c]


@dataclass
class Tried:
    candidate: Candidate
    microbatches: int | None
    plan: Plan | None = None
    error: str = ""
    seconds: float = 0.0


def _refuse_a_count_nothing_divides(traced: Any, gpus: int) -> None:
    """Every mesh of ``gpus`` devices cuts them into factors of ``gpus``; where none of them
    (above 1) divides a dimension of the model or its inputs, each mesh could only repeat the
    work on every device (solve.py ``check_mesh_fits``): once no mesh planned, say that, with
    the largest count that can split something (the full batch's graph is read only then, off
    the search's path)."""
    dims = model_dims(traced)
    if gpus < 2 or any(splits_some(dims, n) for n in range(2, gpus + 1) if gpus % n == 0):
        return
    usable = max((n for n in range(2, gpus) if splits_some(dims, n)), default=1)
    raise AutoshardError(
        f"a device count with a factor that divides some tensor dimension of the model (a mesh "
        f"of {gpus} devices)", got=f"no factor of {gpus} divides a parameter or input "
        f"dimension; dims seen: {sorted(dims)[:12]}",
        fix=f"search {usable} devices (--gpus {usable}; gpus={usable}), or a batch or sequence "
            f"length that {gpus} or one of its factors divides")


@records_searches
def search_mesh(model: torch.nn.Module, example_inputs: Sequence[Any], gpus: int, *,
                gpus_per_node: int | None = None, cluster: Cluster | str = "h100",
                options: PlanOptions | None = None, model_name: str = "",
                time_budget_s: float = 100.0, **overrides: Any) -> Plan:
    """The best plan of ``model`` on ``gpus`` devices over the meshes this module searches; the
    plan's mesh is the one chosen. ``gpus_per_node`` defaults to the cluster's."""
    t0 = time.perf_counter()
    options = resolve_options(options, overrides)
    cluster = Cluster.resolve(cluster)
    gpn = _devices_per_node(gpus, gpus_per_node, cluster, options)
    if gpn != cluster.devices_per_node:
        cluster = dataclasses.replace(cluster, devices_per_node=gpn)
    traces = Traces(model, example_inputs, training=options.training,
                    precision=options.precision)
    batch = traces.full
    cands = _candidates_of(traces, gpus, gpn)
    params = sum(p.numel() for p in model.parameters())
    tried: dict[Candidate, Tried] = {}

    def evaluate(c: Candidate, microbatches: int | None) -> Tried:
        return _evaluate(c, microbatches, traces, cluster, options, model_name)

    def screen(c: Candidate) -> Tried:
        if c not in tried:
            m = microbatches_for(c, batch) if options.microbatches == "auto" or c.pp == 1 \
                else options.microbatches
            tried[c] = evaluate(c, m)
        return tried[c]

    def affordable() -> bool:
        """Another plan fits the time budget, at the mean time a plan has taken so far."""
        spent = [t.seconds for t in tried.values()]
        mean = sum(spent) / len(spent) if spent else 0.0
        return time.perf_counter() - t0 + mean <= time_budget_s

    def solve(t: Try) -> Tried | None:
        """A mesh screened (or screened again at another microbatch count); None once the
        time budget is spent (the first mesh is always planned)."""
        if tried and not affordable():
            return None
        c = t.get("mesh")
        got = evaluate(c, t.get("microbatches")) if t.get("again") else screen(c)
        if got.plan is None:
            raise AutoshardError(f"a plan of mesh {c}", got=got.error,
                                 fix="another mesh of the search")
        return got

    # Local search: to the fastest neighbour while one is faster (a neighbour planned before
    # is no faster than the current mesh, the fastest planned so far).
    first = start(cands, params, 16.0, cluster.memory_bytes)
    search_round([first], solve)
    current = tried[first]
    while affordable():
        near = [c for c in neighbours(current.candidate, cands) if c not in tried]
        better = search_round(near, solve) if near else None
        if better is None or _step(better) >= _step(current):
            break
        current = better
    # Then the rest, nearest the best first, as long as the budget lasts: every candidate of
    # a model that plans fast, the neighbourhood of the best of one that does not.
    def distance(c: Candidate) -> int:
        b = min(tried.values(), key=_step).candidate
        return abs(c.pp.bit_length() - b.pp.bit_length()) + abs(
            c.tp.bit_length() - b.tp.bit_length())
    rest = sorted((c for c in cands if c not in tried), key=distance)
    if rest:
        search_round(rest, solve)
    best = min(tried.values(), key=_step)
    if best.plan is None:
        _refuse_a_count_nothing_divides(traces.at(batch), gpus)
        raise AutoshardError(f"a mesh of {gpus} devices some plan fits",
                             got="; ".join(f"{t.candidate}: {t.error[:100]}"
                                           for t in tried.values()),
                             fix="add devices, or allow more memory techniques")
    if options.microbatches == "auto" and best.candidate.pp > 1:
        _other_counts(best, batch, solve)
    # The tries are in the record of the searches; here the search's own figures.
    search = {"gpus": gpus, "gpus_per_node": gpn, "candidates": len(cands),
              "time_budget_s": time_budget_s, "search_s": round(time.perf_counter() - t0, 2)}
    return replace(best.plan, solver={**best.plan.solver, "mesh_search": search})


def search_round(meshes: Sequence[Candidate], solve, counts: Sequence[int] = ()
                 ) -> Tried | None:
    """One round of the mesh search through the driver: the fastest of ``meshes`` that plans
    (None: none did, or the time budget was spent), every try in the record as "meshes"."""
    return run_search("meshes", mesh_tries(meshes, counts), solve, price=_step,
                      error_of_none="none", step=_step, facts=_facts)[0]


def mesh_tries(meshes: Sequence[Candidate], counts: Sequence[int] = ()) -> list[Try]:
    """The mesh search's tries for a round: each mesh screened (at the microbatch count it is
    screened at), or, with ``counts``, the chosen mesh planned again at each of them."""
    if counts:
        return [Try(f"{c} at {m} microbatches", (("mesh", c), ("microbatches", m),
                                                  ("again", True)), announce=False)
                for c in meshes for m in counts]
    return [Try(str(c), (("mesh", c),), announce=False) for c in meshes]


def _other_counts(best: Tried, batch: int, solve) -> None:
    """The chosen mesh at the other microbatch counts the planner tries (p, 2p, 4p): the
    fastest kept in ``best`` if it beats the screened count."""
    pp, dp = best.candidate.pp, best.candidate.dp
    counts = [m for m in (pp, 2 * pp, 4 * pp)
              if m != best.microbatches and not batch % m and not (batch // m) % dp]
    again = search_round([best.candidate], solve, counts) if counts else None
    if again is not None and _step(again) < _step(best):
        best.plan, best.microbatches = again.plan, again.microbatches


def _step(t: Tried) -> float:
    return t.plan.predicted.step_time_s if t.plan is not None else float("inf")


def _facts(t: Tried) -> dict[str, Any]:
    """A mesh try's record beside its step: its pipeline's microbatches and schedule, and the
    seconds it took to plan."""
    return {**plan_facts(t.plan), "plan_s": round(t.seconds, 2)}


def _evaluate(c: Candidate, microbatches: int | None, traces: Traces, cluster: Cluster,
              options: PlanOptions, model_name: str) -> Tried:
    """One mesh of the search planned (``microbatches`` 0: none divides the batch)."""
    from autoshard.solver.planner import plan_with
    t = Tried(c, microbatches)
    if microbatches == 0:
        t.error = f"no microbatch count of {c.pp}, {2 * c.pp} or {4 * c.pp} that dp{c.dp} " \
                  f"divides into batch {traces.full}"
        return t
    mesh = Mesh(c.shape, c.axes, cluster=cluster)
    opts = options.replace(pipeline="pp" if c.pp > 1 else None,
                           microbatches=microbatches or "auto")
    t1 = time.perf_counter()
    try:
        with progress.step(f"mesh {c} ({'x'.join(map(str, c.shape))}"
                           f"{f', {microbatches} microbatches' if microbatches else ''})"):
            t.plan = plan_with(traces, mesh, opts, model_name=model_name)
    except AutoshardError as e:
        t.error = e.got or str(e)
    t.seconds = time.perf_counter() - t1
    return t


def _devices_per_node(gpus: int, gpus_per_node: int | None, cluster: Cluster,
                      options: PlanOptions) -> int:
    """The devices per node of a mesh search, its arguments checked first."""
    if not isinstance(gpus, int) or gpus < 1:
        raise AutoshardError("--gpus is a positive number of devices", got=repr(gpus),
                             fix="e.g. --gpus 64")
    gpn = cluster.devices_per_node if gpus_per_node is None else gpus_per_node
    if not isinstance(gpn, int) or gpn < 1:
        raise AutoshardError("--gpus-per-node is a positive number of devices",
                             got=repr(gpus_per_node), fix="e.g. --gpus-per-node 8")
    if gpus > gpn and gpus % gpn:
        raise AutoshardError(f"a number of devices that fills whole nodes of {gpn}",
                             got=f"--gpus {gpus}", fix=f"use a multiple of {gpn}, or set "
                                                      "--gpus-per-node")
    if options.pipeline not in (None, "auto", "pp"):
        raise AutoshardError("pipeline unset, 'auto' or 'pp' with a mesh search (its pipeline "
                             "axis is named pp)", got=repr(options.pipeline),
                             fix="leave --pipeline out: the search decides")
    return gpn


def _candidates_of(traces: Traces, gpus: int, gpn: int) -> list[Candidate]:
    """The meshes to search for the traced model, or why there are none."""
    batch = traces.full
    cands = candidates(gpus, min(gpn, gpus), batch, _layers(traces, batch))
    if not cands:
        raise AutoshardError(f"a batch that some data axis of {gpus} devices divides",
                             got=f"batch {batch}", fix="use a batch with more factors of 2, or "
                                                      "fewer devices")
    return cands


def _layers(traces: Traces, batch: int) -> int:
    """The model's repeated layers (every candidate's graph has the same), from the graph of
    a small batch: the first concrete trace, which later batches are rebatched from."""
    return len(traces.at(next((d for d in divisors(batch) if d >= 2), batch)).layers)
