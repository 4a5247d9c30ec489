"""Why a plan places a node or a parameter as it does, and where its communication goes.

``autoshard explain plan.json --node NAME`` (or ``--param FQN``) answers "what would the other
choices cost?" with real re-solves, not local estimates: the model is traced again from the name
and input shapes the plan records (its fingerprint must match), the ILP the plan was solved on is
built again (the same options, checkpointed layers and offload), and it is solved once with the
node held to its chosen strategy -- the *baseline* -- and once with the node held to each of the
``k`` next-best strategies. A row's deltas are that re-solved plan's predicted figures minus the
baseline's, both assembled by the planner's own ``assemble``, so they are the same prices as any
plan's. The baseline is a re-solve too, not the plan file: with a nonzero solver gap (a time
limit), or a plan the planner adjusted after its solve (re-planned for the step's liveness
peak, or checkpointing priced per layer), the file's step may differ from it; both are shown.

The next-best strategies are those whose swap *alone* (every other decision as the baseline has
it, priced by ``evaluate`` on the same ILP) is cheapest, those that fit the memory budget first:
a short list of plausible choices, which the re-solves then price with the rest of the plan free
to adapt. A node held to a strategy holds its whole decision: the follower ops merged into it
and every identical layer sharing it (trace/layers.py), as the planner decides them together.

``--top N`` lists the most expensive collectives of the plan's ledger, each repeated collective
of identical layers folded into one row, with the node that needs it, its layer and the model
source line that produced that node (from the re-trace; torch.export keeps the stack in
``node.meta``). Plan files do not store source lines: they name files on the planning machine.
"""
from __future__ import annotations

import json
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.plans import Plan
from autoshard.tools.explain.choices import (DEFAULT_ALTERNATIVES, DEFAULT_TIME_LIMIT_S,
                                             check_count, check_param, explain_node,
                                             explain_param, node_of)
from autoshard.tools.explain.ledger import check_top, ledger_seconds, top_collectives
from autoshard.tools.explain.rebuild import check_resolvable, plan_mesh, rebuild
from autoshard.tools.explain.render import render_explanation, render_top


def explain_file(path: str | Path, *, node: str | None = None, param: str | None = None,
                 top: int | None = None, alternatives: int = DEFAULT_ALTERNATIVES,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S, model: str | None = None,
                 cluster: str | None = None, task: str | None = None,
                 as_json: bool = False) -> str:
    """What ``autoshard explain PLAN`` prints: exactly one of ``node``, ``param``, ``top``."""
    if sum(x is not None for x in (node, param, top)) != 1:
        raise AutoshardError("exactly one of --node NAME, --param FQN, --top N",
                             got=f"node={node!r}, param={param!r}, top={top!r}",
                             fix="e.g. autoshard explain plan.json --top 10")
    plan = Plan.load(path)
    if top is not None:
        check_top(top)
        rebuilt, why = None, ""
        try:
            rebuilt = rebuild(plan, model=model, cluster=cluster, task=task)
        except AutoshardError as e:       # the ledger alone still ranks the collectives
            why = str(e)
        rows = top_collectives(plan, top, rebuilt=rebuilt, cluster=cluster)
        ledger_s = ledger_seconds(plan, rebuilt.mesh if rebuilt else plan_mesh(plan, cluster))
        if as_json:
            return json.dumps({"collectives": [r.to_json() for r in rows],
                               "ledger_s": ledger_s, "sources": why or "re-traced",
                               "seconds": {"rebuild_s": rebuilt.seconds if rebuilt else 0.0}},
                              indent=1)
        return render_top(plan, rows, ledger_s=ledger_s, sources=why)
    # Every mistake the file alone shows is refused before the model is traced again.
    check_count(alternatives, time_limit_s)
    if node is not None:
        node_of(plan, node)
    else:
        check_param(plan, param)
    check_resolvable(plan)
    rebuilt = rebuild(plan, model=model, cluster=cluster, task=task)
    kw = {"rebuilt": rebuilt, "alternatives": alternatives, "time_limit_s": time_limit_s}
    e = explain_node(plan, node, **kw) if node is not None else explain_param(plan, param, **kw)
    return json.dumps(e.to_json(), indent=1) if as_json else render_explanation(e)

