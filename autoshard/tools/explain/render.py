"""An explanation and the top collectives as the command prints them."""
from __future__ import annotations

from typing import TYPE_CHECKING

from autoshard.plans import Plan
from autoshard.plans.summary import size_text
from autoshard.plans.summary import ranges
from autoshard.tools.explain.ledger import TopCollective

if TYPE_CHECKING:
    from autoshard.tools.explain.choices import Explanation, Row


def _ms(seconds: float, *, signed: bool = False) -> str:
    """Milliseconds to the microsecond; below 10 us in microseconds, so that a tiny model's
    deltas do not all read 0.000 ms."""
    sign = "+" if signed else ""
    if 0 < abs(seconds) < 1e-5:
        return f"{seconds * 1e6:{sign}.3f} us"
    return f"{seconds * 1e3:{sign}.3f} ms"


def _signed_size(nbytes: float) -> str:
    return ("+" if nbytes >= 0 else "") + size_text(nbytes)


def render_explanation(e: Explanation) -> str:
    """The explanation as ``autoshard explain --node/--param`` prints it."""
    what = f"parameter {e.param} (graph input {e.node})" if e.param else \
        f"node {e.node} ({e.op})"
    lines = [f"autoshard explain: {what}"]
    if e.module:
        lines.append(f"  module: {e.module}")
    if e.source is None:
        lines.append("  source: (torch.export kept no stack for this node)")
    elif e.source_node != e.node:
        lines.append(f"  source (its first reader, {e.source_node}): {e.source}")
    else:
        lines.append(f"  source: {e.source}")
    if e.source is not None and e.source.caller is not None:
        lines.append(f"    called from {e.source.caller}")
    if len(e.shared_layers) > 1:
        lines.append(f"  layer: {e.layer}, decided once with the identical layers "
                     f"{_layer_span(e.shared_layers)}: a strategy held here holds in all "
                     f"{len(e.shared_layers)}")
    elif e.layer:
        lines.append(f"  layer: {e.layer}")
    if e.template != e.node:
        lines.append(f"  decided as its counterpart in {e.shared_layers[0]}: {e.template}")
    others = [n for n in e.decision_nodes if n != e.template]
    if others:
        shown = ", ".join(others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6
                                          else "")
        lines.append(f"  one decision with {_plural(len(others), 'other node')} (the ops that "
                     f"follow one producer's layout): {shown}")
    lines.append(f"  chosen: {e.chosen}   ({_plural(e.strategies, 'strategy', 'strategies')} "
                 f"in all)")
    b = e.baseline
    lines.append(f"  plan file: step {_ms(e.file_step_s)}, peak memory "
                 f"{size_text(e.file_memory_bytes)} per device")
    lines.append(f"  baseline = the plan re-solved with the chosen strategy pinned ({b.status}): "
                 f"step {_ms(b.step_time_s)}{_file_gap(e)}, peak memory "
                 f"{size_text(b.memory_bytes)}, step peak (liveness) {size_text(b.live_peak_bytes)}")
    if not e.rows:
        lines.append("  no alternative: the node has no other strategy" if e.strategies <= 1
                     else "  no alternative asked for (--alternatives 0)")
    else:
        lines.append(f"  next-best strategies (the {len(e.rows)} cheapest swapped in alone), each "
                     f"re-solved with it pinned ({e.time_limit_s:g} s limit); delta = re-solved "
                     f"plan - baseline:")
        for i, r in enumerate(e.rows, 1):
            lines += _row_lines(i, r)
    lines += [f"  note: {n}" for n in e.notes]
    s = e.seconds
    solves = s.get("baseline_s", 0.0) + s.get("alternatives_s", 0.0)
    lines.append(f"  took {s.get('rebuild_s', 0.0) + s.get('explain_s', 0.0):.1f} s: trace "
                 f"{s.get('rebuild_s', 0.0):.1f} s, ILP build {s.get('build_s', 0.0):.1f} s, "
                 f"{len(e.rows) + 1} re-solves {solves:.1f} s")
    return "\n".join(lines)


def _file_gap(e: Explanation) -> str:
    d = e.baseline.step_time_s - e.file_step_s
    if abs(d) <= 1e-9 * e.file_step_s:
        return " (the plan file's)"
    return f" ({_ms(d, signed=True)} from the plan file's)"


def _row_lines(i: int, r: Row) -> list[str]:
    x = r.resolved
    alone = "" if x.alone_step_s is None else f"; swapped in alone {_ms(x.alone_step_s)}"
    if x.plan is None:
        return [f"    {i}. {x.strategy}", f"       {x.status}{alone}"]
    delta = _ms(r.step_delta_s, signed=True)
    if r.step_delta_bound_s is not None and r.step_delta_bound_s < r.step_delta_s - 1e-12:
        delta = f"between {_ms(r.step_delta_bound_s, signed=True)} and {delta}: time limit"
    return [f"    {i}. {x.strategy}",
            f"       step {_ms(x.step_time_s)} ({delta}), peak memory {size_text(x.memory_bytes)} "
            f"({_signed_size(r.memory_delta_bytes)}), step peak "
            f"{_signed_size(r.live_peak_delta_bytes)}{alone}",
            f"       {x.status}; moves {_plural(r.moved, 'other decision')}, "
            f"{_plural(r.params_moved, 'parameter layout')}"]


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else many or word + 's'}"


def _layer_span(names: tuple[str, ...]) -> str:
    container = names[0].rpartition(".")[0]
    if all(n.rpartition(".")[0] == container for n in names):
        return f"{container} {ranges(int(n.rpartition('.')[2]) for n in names)}"
    return ", ".join(names)


def render_top(plan: Plan, rows: list[TopCollective], *, ledger_s: float,
               sources: str = "") -> str:
    """The list ``autoshard explain --top N`` prints: ``ledger_s`` is the seconds of every
    collective of the plan (``ledger_seconds``); ``sources``: why it has no source lines."""
    p = plan.predicted
    if not plan.collectives:
        return (f"autoshard explain: the plan of {plan.model or 'this model'} runs no "
                f"collectives (every device runs the whole step on its own data)")
    comm = ledger_s
    lines = [f"autoshard explain: the {len(rows)} most expensive collectives per step of "
             f"{plan.model or 'the plan'} on mesh {'x'.join(map(str, plan.mesh_shape))} "
             f"(alpha-beta seconds; a collective of identical layers is one row, with the "
             f"seconds of all) of the ledger's {_ms(comm)} per step. The plan's comm: "
             f"{_ms(p.comm_s)} (each gradient priced by its share of its bucket), of which "
             f"{_ms(p.exposed_comm_total_s)} exposed"]
    for i, t in enumerate(rows, 1):
        share = f", {t.seconds / comm:.1%}" if comm else ""
        each = f" x{t.instances} ({_ms(t.seconds_each)} each)" if t.instances > 1 else ""
        stage = f" on stage {t.stage}" if t.stage >= 0 else ""
        lines.append(f"  {i:2d}. {_ms(t.seconds)}{share}: {t.phase} {t.kind} over "
                     f"{','.join(t.axes)}{stage}, {size_text(t.bytes)}{each}")
        if t.members:
            lines.append(f"      gradient bucket {t.node} of {_plural(len(t.members), 'parameter')}"
                         + (f" in {t.layers}" if t.layers else "") + f": {t.members[0]}"
                         + (f" .. {t.members[-1]}" if len(t.members) > 1 else ""))
            continue
        if t.node == "optimizer":        # codegen/optim.py: after the step, shards gathered
            lines.append(f"      after the optimizer step, gathering {t.value}'s updated shards"
                         + (f" in {t.layers}" if t.layers else ""))
            continue
        moves = f", moving {t.value}" if t.value and t.value != t.node else ""
        lines.append(f"      for {t.node}" + (f" ({t.op})" if t.op else "")
                     + (f", {t.module}," if t.module else "")
                     + (f" in {t.layers}" if t.layers else "") + moves)
        if t.source is not None:
            lines.append(f"      source: {t.source}")
    total = sum(t.seconds for t in rows)
    lines.append(f"  these rows: {_ms(total)}"
                 + (f", {total / comm:.1%} of the ledger's" if comm else "")
                 + "; grad_sync buckets run behind backward compute as far as it hides them")
    if sources:
        lines.append(f"  no source lines: {sources}")
    return "\n".join(lines)

