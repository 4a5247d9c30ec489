"""Compare two plans of one model: what is placed differently, and what it does to the step.

``diff_plans(a, b)`` returns a ``PlanDiff``: the settings that differ (mesh, cluster, options),
the predicted figures of both plans and their difference (step, compute, comm, peak memory),
the collectives' bytes, count and alpha-beta seconds per mesh axis and per phase, and every
parameter, model input, op and collective whose placement or bytes differ. A difference repeated
across the model's layers (``Plan.layers``) is one entry naming the layers: "layers 0-31:
attn.q_proj.weight [S(0), R] -> [R, R]", not 32. ``render(diff)`` is the text ``autoshard diff``
prints; ``PlanDiff.to_json()`` what ``autoshard diff --json`` prints. Deltas are ``b - a``.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable

from autoshard.errors import AutoshardError
from autoshard.ir import Phase, spec_str
from autoshard.plans import Plan
from autoshard.plans.prediction import PREDICTED
from autoshard.plans.records import PHASES, NodePlan
from autoshard.plans.summary import ranges, size_text

# node name -> (layer container, block number, position in the layer's node list, the first
# identical layer: whose node at that position does the same)
_Where = tuple[str, int, int, str]


@dataclass(frozen=True)
class Change:
    """One line of a diff: a parameter, input, op or collective whose placement or bytes differ
    between the plans, folded over the layers where the same change repeats.

    ``layers`` is ``"layers 0-31"`` (the container's path and the block numbers) or ``""``
    outside the repeated layers; ``what`` the parameter's name within its layer (the full name
    outside), the op, or the collective; ``a`` and ``b`` its placement or bytes in each plan
    (``"none"``: not in that plan); ``names`` every full name folded into the line.
    """

    layers: str
    what: str
    a: str
    b: str
    names: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "what": self.what, "a": self.a, "b": self.b,
                "count": len(self.names), "names": list(self.names)}


@dataclass(frozen=True)
class Figure:
    """One figure in both plans; ``delta`` is ``b - a``."""

    a: float
    b: float

    @property
    def delta(self) -> float:
        return self.b - self.a

    def to_json(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "delta": self.delta}


@dataclass(frozen=True)
class PlanDiff:
    names: tuple[str, str]                     # how the two plans are called (their files)
    model: str
    fingerprints: tuple[str, str]
    settings: dict[str, tuple[Any, Any]]       # mesh, cluster, options fields that differ
    predicted: dict[str, Figure]               # PREDICTED figures: step_time_s, ..., memory
    comm_by_axis: dict[str, dict[str, Figure]]   # axis -> {bytes, count, seconds}
    comm_by_phase: dict[str, dict[str, Figure]]  # phase -> {bytes, count, seconds}
    params: tuple[Change, ...]
    inputs: tuple[Change, ...]
    nodes: tuple[Change, ...]
    collectives: tuple[Change, ...]
    sizes: dict[str, tuple[int, int]]          # params, nodes, collectives: totals in a and b
    only_in: dict[str, dict[str, list[str]]] = field(default_factory=dict)   # --force: names

    @property
    def empty(self) -> bool:
        """True when the plans agree on every setting, placement, collective and figure."""
        return not (self.fingerprints[0] != self.fingerprints[1] or self.settings
                    or self.params or self.inputs or self.nodes or self.collectives
                    or any(f.delta for f in self.predicted.values()))

    def to_json(self) -> dict[str, Any]:
        def figures(table: dict[str, dict[str, Figure]]) -> dict:
            return {k: {n: f.to_json() for n, f in v.items()} for k, v in table.items()}
        return {
            "a": self.names[0], "b": self.names[1], "model": self.model,
            "fingerprint": {"a": self.fingerprints[0], "b": self.fingerprints[1],
                            "same": self.fingerprints[0] == self.fingerprints[1]},
            "empty": self.empty,
            "settings": {k: {"a": a, "b": b} for k, (a, b) in self.settings.items()},
            "predicted": {k: f.to_json() for k, f in self.predicted.items()},
            "comm_by_axis": figures(self.comm_by_axis),
            "comm_by_phase": figures(self.comm_by_phase),
            "params": [c.to_json() for c in self.params],
            "inputs": [c.to_json() for c in self.inputs],
            "nodes": [c.to_json() for c in self.nodes],
            "collectives": [c.to_json() for c in self.collectives],
            "sizes": {k: {"a": a, "b": b} for k, (a, b) in self.sizes.items()},
            "only_in": self.only_in,
        }


# ------------------------------------------------------------------------------------ building

def diff_files(path_a: str | Path, path_b: str | Path, *, force: bool = False) -> PlanDiff:
    """``diff_plans`` of two plan files, named by their paths."""
    return diff_plans(Plan.load(path_a), Plan.load(path_b), force=force,
                      names=(str(path_a), str(path_b)))


def diff_plans(a: Plan, b: Plan, *, force: bool = False,
               names: tuple[str, str] = ("a", "b")) -> PlanDiff:
    """What differs between plans ``a`` and ``b`` of one model (equal fingerprints: the same
    traced graph and input shapes). ``force`` compares plans of different graphs anyway, by
    parameter and node name, listing the names only one of them has."""
    if a.fingerprint != b.fingerprint and not force:
        first = _first_signature_differences(a, b)
        raise AutoshardError("two plans of the same model and input shapes (equal fingerprints)",
                             got=f"{names[0]} ({a.model or 'model not named'}) has fingerprint "
                                 f"{a.fingerprint}, {names[1]} ({b.model or 'model not named'}) "
                                 f"{b.fingerprint}" + (f"; first differing nodes: {first}"
                                                       if first else ""),
                             fix="diff two plans of one model (same --batch and --seq), or pass "
                                 "--force (force=True) to compare their common names anyway")
    layout = _Layout(a)
    param_pairs = _pairs(a.params, b.params)
    node_a = {n.name: n for n in a.nodes if n.op != "placeholder"}
    node_b = {n.name: n for n in b.nodes if n.op != "placeholder"}
    only_in = {}
    if a.fingerprint != b.fingerprint:
        only_in = {"a": {"params": sorted(a.params.keys() - b.params.keys()),
                         "nodes": sorted(node_a.keys() - node_b.keys())},
                   "b": {"params": sorted(b.params.keys() - a.params.keys()),
                         "nodes": sorted(node_b.keys() - node_a.keys())}}
    return PlanDiff(
        names=names, model=_model_name(a.model, b.model),
        fingerprints=(a.fingerprint, b.fingerprint),
        settings=_settings(a, b),
        predicted=_predicted(a, b),
        comm_by_axis=_comm_table(a, b, lambda c: ",".join(c.axes),
                                 order=list(a.mesh_axes) + list(b.mesh_axes)),
        comm_by_phase=_comm_table(a, b, lambda c: c.phase, order=list(PHASES)),
        params=_param_changes(layout, param_pairs),
        inputs=tuple(Change("", k, spec_str(x), spec_str(y), (k,))
                     for k, (x, y) in _pairs(a.inputs, b.inputs).items() if x != y),
        nodes=_node_changes(layout, _pairs(node_a, node_b)),
        collectives=_collective_changes(layout, a, b),
        sizes={"params": (len(a.params), len(b.params)), "nodes": (len(node_a), len(node_b)),
               "collectives": (len(a.collectives), len(b.collectives))},
        only_in=only_in)


def _predicted(a: Plan, b: Plan) -> dict[str, Figure]:
    """The PREDICTED figures, then any other the plans carry (a figure per mesh axis, such as
    the exposed comm, as ``exposed_comm_s.dp``); a figure one plan lacks counts 0 there. The
    figures are named as the plan file names them (``Prediction.to_json``)."""
    pa, pb = a.predicted.to_json(), b.predicted.to_json()
    out = {k: Figure(float(pa[k]), float(pb[k])) for k in PREDICTED}
    for k in dict.fromkeys(list(pa) + list(pb)):
        x, y = pa.get(k), pb.get(k)
        if k in PREDICTED:
            continue
        if all(v is None or isinstance(v, dict) for v in (x, y)):
            x, y = x or {}, y or {}
            for sub in dict.fromkeys(list(x) + list(y)):
                if all(isinstance(v, (int, float)) for v in (x.get(sub, 0), y.get(sub, 0))):
                    out[f"{k}.{sub}"] = Figure(float(x.get(sub, 0)), float(y.get(sub, 0)))
        elif all(v is None or isinstance(v, (int, float)) for v in (x, y)):
            out[k] = Figure(float(x or 0), float(y or 0))
    return out


def _model_name(a: str, b: str) -> str:
    """The model both plans name (a baseline made in Python may name none)."""
    return a if a == b or not b else b if not a else f"{a} / {b}"


def _pairs(a: dict, b: dict) -> dict:
    """Keys in both, in ``a``'s order, with the two values."""
    return {k: (v, b[k]) for k, v in a.items() if k in b}


def _first_signature_differences(a: Plan, b: Plan) -> str:
    diffs = [n for n in dict.fromkeys(list(a.node_sigs) + list(b.node_sigs))
             if a.node_sigs.get(n) != b.node_sigs.get(n)]
    return ", ".join(diffs[:3])


def _settings(a: Plan, b: Plan) -> dict[str, tuple[Any, Any]]:
    """The settings that differ, as the plan files write them (the mesh as text)."""
    out = {}
    pairs = {"mesh": (_mesh_text(a), _mesh_text(b)), "cluster": (a.cluster_text, b.cluster_text)}
    oa, ob = a.options.to_json(), b.options.to_json()
    for k in dict.fromkeys(list(oa) + list(ob)):
        pairs[f"options.{k}"] = (oa.get(k), ob.get(k))
    for k, (x, y) in pairs.items():
        if x != y:
            out[k] = (x, y)
    return out


def _mesh_text(p: Plan) -> str:
    return f"{'x'.join(map(str, p.mesh_shape))} ({','.join(p.mesh_axes)})"


def _setting_text(key: str, value: Any) -> str:
    if key == "options.memory_budget" and isinstance(value, (int, float)):
        return size_text(value)
    return "default" if value is None else str(value)


def _comm_table(a: Plan, b: Plan, key: Callable[[Any], str],
                order: list[str]) -> dict[str, dict[str, Figure]]:
    """bytes, count and alpha-beta seconds of the collectives per ``key`` (axis or phase), in
    ``order`` (mesh axes, or phases in step order), any other key after."""
    sums = [_comm_sums(p, key) for p in (a, b)]
    keys = sorted(dict.fromkeys(list(sums[0]) + list(sums[1])),
                  key=lambda k: order.index(k) if k in order else len(order))
    out = {}
    for k in keys:
        row = {}
        for what in ("bytes", "count", "seconds"):
            x, y = (s.get(k, {}).get(what, 0.0) for s in sums)
            if x is not None and y is not None:
                row[what] = Figure(float(x), float(y))
        out[k] = row
    return out


def _comm_sums(p: Plan, key: Callable[[Any], str]) -> dict[str, dict[str, float | None]]:
    seconds = _collective_seconds(p)
    out: dict[str, dict[str, float | None]] = {}
    for i, c in enumerate(p.collectives):
        row = out.setdefault(key(c), {"bytes": 0.0, "count": 0.0,
                                      "seconds": 0.0 if seconds is not None else None})
        row["bytes"] += c.bytes
        row["count"] += 1
        if seconds is not None:
            row["seconds"] += seconds[i]
    return out


def _collective_seconds(p: Plan) -> list[float] | None:
    """Each collective's alpha-beta seconds on the plan's mesh and cluster (docs/cost-model.md
    §1), whose sum is the plan's predicted comm, on the cluster figures the plan records; None
    for an old file that names a profile without its figures. A gradient bucket's collective
    pays the share of a latency its gradients were priced (cost/overlap.py): a partly filled
    bucket, its fill."""
    from autoshard.cost.comm import link_time
    from autoshard.cost.overlap import latency_share
    try:
        mesh = p.mesh()
    except AutoshardError:      # a file written before plans recorded their cluster's figures
        return None
    out = []
    for c in p.collectives:
        axes = [p.mesh_axes.index(x) for x in c.axes if x in p.mesh_axes]
        if len(axes) != 1:      # the ledger runs each collective over one axis
            return None
        share = latency_share(c.bytes, p.options.bucket_bytes) \
            if c.phase == Phase.GRAD_SYNC and c.members else 1.0
        out.append(link_time(mesh.links[axes[0]], c.kind, mesh.shape[axes[0]], c.bytes,
                             latency_share=share))
    return out


# ----------------------------------------------------------------------- folding over layers

class _Layout:
    """Where each parameter and node sits among the model's repeated layers, so that the same
    change in blocks 0..31 reads as one line."""

    def __init__(self, plan: Plan) -> None:
        self.node: dict[str, _Where] = {}
        self.layer_names: list[tuple[str, str, int]] = []      # (layer name, container, number)
        nodes_of = {layer.name: layer.nodes for layer in plan.layers}
        for layer in plan.layers:
            container, _, number = layer.name.rpartition(".")
            self.layer_names.append((layer.name, container, int(number)))
            for pos, n in enumerate(layer.nodes):
                self.node.setdefault(n, (container, int(number), pos, layer.same_as))
        # A node is named on a folded line by its counterpart in the first identical layer.
        self.template = {n: nodes_of[w[3]][w[2]] for n, w in self.node.items()
                         if w[3] in nodes_of and w[2] < len(nodes_of[w[3]])}
        # Longest first, so that "encoder.block.1" does not claim "encoder.block.10.x".
        self.layer_names.sort(key=lambda t: -len(t[0]))
        self.param_short = _param_short_names(plan)

    def param(self, fqn: str) -> tuple[str, int, str] | None:
        """(container, number, name within the layer) of a parameter inside a layer."""
        for name, container, number in self.layer_names:
            if fqn.startswith(name + "."):
                return container, number, fqn[len(name) + 1:]
        m = re.match(r"^(.*?)\.(\d+)\.(.+)$", fqn)      # a plan without recorded layers
        return (m.group(1), int(m.group(2)), m.group(3)) if m else None

    def relative(self, name: str, base: int | None) -> Hashable:
        """A node's place in its kind of layer and block ``base`` (its own block when None), or
        its name outside the layers: equal for the same node of identical layers."""
        where = self.node.get(name)
        if where is None:
            return name
        _, number, pos, same_as = where
        return (same_as, number - (number if base is None else base), pos)

    def label(self, name: str) -> str:
        """How a node is named on a folded line: a parameter by its name within its layer, any
        other node by its name in the first layer that has it."""
        if name in self.param_short:
            fqn = self.param_short[name]
            where = self.param(fqn)
            return fqn if where is None else where[2]
        return self.template.get(name, name)


def _param_short_names(plan: Plan) -> dict[str, str]:
    """placeholder node name -> parameter name, as torch.export names parameter inputs
    (``p_`` + the dotted path with ``_``), under our loss wrapper's ``model.`` or not."""
    sanitized = {}
    for fqn in plan.params:
        flat = re.sub(r"[^0-9a-zA-Z_]", "_", fqn)
        sanitized[f"p_{flat}"] = fqn
        sanitized[f"p_model_{flat}"] = fqn
    return {n.name: sanitized[n.name] for n in plan.nodes
            if n.op == "placeholder" and n.name in sanitized}


def _fold(items: Iterable[tuple[Hashable, str | None, int | None, str, str, str, str]]
          ) -> tuple[Change, ...]:
    """Lines from (key, container, number, what, a, b, full name): the items of one key fold
    into one Change naming their blocks, in the order of first appearance."""
    groups: dict[Hashable, list] = {}
    for key, container, number, what, a, b, name in items:
        groups.setdefault(key, []).append((container, number, what, a, b, name))
    out = []
    for members in groups.values():
        container, _, what, a, b, _ = members[0]
        numbers = [m[1] for m in members if m[1] is not None]
        layers = f"{container} {ranges(numbers)}" if container is not None and numbers else ""
        out.append(Change(layers, what, a, b, tuple(m[5] for m in members)))
    return tuple(out)


def _param_changes(layout: _Layout, pairs: dict[str, tuple]) -> tuple[Change, ...]:
    items = []
    for fqn, (x, y) in pairs.items():
        if x == y:
            continue
        a, b = spec_str(x), spec_str(y)
        where = layout.param(fqn)
        if where is None:
            items.append((("", fqn), None, None, fqn, a, b, fqn))
        else:
            container, number, short = where
            items.append(((container, short, a, b), container, number, short, a, b, fqn))
    return _fold(items)


def _strategy_text(n: NodePlan) -> str:
    ins = " x ".join(spec_str(s) for s in n.inputs)
    outs = ", ".join(spec_str(s) for s in n.outputs)
    return f"{ins} -> {outs}" + (f" ({n.kernel})" if n.kernel else "")


def _node_changes(layout: _Layout, pairs: dict[str, tuple[NodePlan, NodePlan]]
                  ) -> tuple[Change, ...]:
    items = []
    for name, (x, y) in pairs.items():
        a, b = _strategy_text(x), _strategy_text(y)
        if a == b:
            continue
        what = f"{layout.label(name)} ({x.op})"
        where = layout.node.get(name)
        container, number = (where[0], where[1]) if where else (None, None)
        key = (layout.relative(name, None), x.op, a, b)
        items.append((key, container, number, what, a, b, name))
    return _fold(items)


def _collective_changes(layout: _Layout, a: Plan, b: Plan) -> tuple[Change, ...]:
    """Collectives keyed by (phase, kind, axes, consumer, value), a gradient bucket by the
    parameters it carries rather than its number: where the bytes (or the number of them)
    differ between the plans, one Change, folded over layers."""
    def table(p: Plan) -> dict[tuple, list[int]]:
        t: dict[tuple, list[int]] = {}
        for c in p.collectives:
            members = tuple(getattr(c, "members", ()) or ())
            node = ("bucket", members) if members else c.node
            t.setdefault((c.phase, c.kind, c.axes, node, c.value), []).append(c.bytes)
        return {k: sorted(v) for k, v in t.items()}

    ta, tb = table(a), table(b)
    items = []
    for key in dict.fromkeys(list(ta) + list(tb)):
        xa, xb = ta.get(key, []), tb.get(key, [])
        if xa == xb:
            continue
        phase, kind, axes, node, value = key
        sa, sb = _bytes_list(xa), _bytes_list(xb)
        if isinstance(node, tuple):         # a bucket: placed where its first parameter is
            members = node[1]
            where = layout.node.get(members[0])
            base = where[1] if where else None
            node_key: Hashable = ("bucket", tuple(
                layout.relative(m, base) if base is not None else m for m in members))
            more = f" and {len(members) - 1} more" if len(members) > 1 else ""
            reader, name = f"a bucket of {layout.label(members[0])}{more}", ",".join(members)
        else:
            where = layout.node.get(node)
            base = where[1] if where else None
            node_key, reader, name = layout.relative(node, None), layout.label(node), node
        container, number = (where[0], where[1]) if where else (None, None)
        of = f" of {layout.label(value)}" if value else ""
        what = f"{phase} {kind} over {','.join(axes)}{of} for {reader}"
        # A consumer outside the layers keeps every value apart: its line names one value.
        value_key = layout.relative(value, base) if value and base is not None else value
        fold_key = (phase, kind, axes, node_key, value_key, sa, sb)
        items.append((fold_key, container, number, what, sa, sb,
                      f"{name} <- {value}" if value else name))
    return _fold(items)


def _bytes_list(sizes: list[int]) -> str:
    if not sizes:
        return "none"
    counts = Counter(sizes)
    return " + ".join(size_text(s) if n == 1 else f"{n} x {size_text(s)}"
                      for s, n in sorted(counts.items()))


# -------------------------------------------------------------------------------------- text

def _signed(value: float, fmt: Callable[[float], str]) -> str:
    return ("+" if value >= 0 else "-") + fmt(abs(value))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _pct(f: Figure) -> str:
    return f" ({f.delta / f.a:+.1%})" if f.a else ""


_FIGURE_ROWS = (("step", "step_time_s", _ms), ("compute", "compute_s", _ms),
                ("comm", "comm_s", _ms), ("ILP memory sum", "ilp_memory_bytes", size_text))


def _figure_label(key: str) -> str:
    """``exposed_comm_s.dp`` -> ``exposed comm, dp``."""
    base, _, sub = key.partition(".")
    base = re.sub(r"_(s|bytes)$", "", base).replace("_", " ")
    return f"{base}, {sub}" if sub else base


def _figure_format(key: str) -> Callable[[float], str]:
    base = key.partition(".")[0]
    return _ms if base.endswith("_s") else size_text if base.endswith("_bytes") else "{:g}".format


def render(d: PlanDiff, *, limit: int = 40) -> str:
    """The diff as text: settings, predicted figures, comm per axis and phase, then the
    parameters, inputs, ops and collectives that changed (``limit`` lines each; 0: all)."""
    same = d.fingerprints[0] == d.fingerprints[1]
    lines = [f"autoshard diff {d.names[0]} -> {d.names[1]}: model {d.model or '(not named)'}, "
             + (f"fingerprint {d.fingerprints[0]}" if same else
                f"DIFFERENT fingerprints {d.fingerprints[0]} / {d.fingerprints[1]} (--force: "
                f"only names in both are compared)")]
    if d.empty:
        lines.append("  no difference: every setting, parameter, op and collective is placed "
                     "alike, and the predicted figures are equal")
        return "\n".join(lines)
    for k, (a, b) in d.settings.items():
        lines.append(f"  {k}: {_setting_text(k, a)} -> {_setting_text(k, b)}")
    lines.append("  predicted per device (b - a):")
    rows = [(label, d.predicted[key], fmt) for label, key, fmt in _FIGURE_ROWS]
    rows += [(_figure_label(k), f, _figure_format(k)) for k, f in d.predicted.items()
             if k not in PREDICTED]
    width = max(len(label) for label, _, _ in rows)
    for label, f, fmt in rows:
        lines.append(f"    {label:{width}s} {fmt(f.a):>12s} -> {fmt(f.b):>12s}   "
                     f"{_signed(f.delta, fmt):>13s}{_pct(f)}")
    for title, table in (("axis", d.comm_by_axis), ("phase", d.comm_by_phase)):
        rows = [(k, r) for k, r in table.items() if any(f.delta for f in r.values())]
        if not rows:
            continue
        lines.append(f"  collectives per mesh {title} (bytes per rank, count, alpha-beta time):"
                     if title == "axis" else
                     f"  collectives per {title} (bytes per rank, count, alpha-beta time):")
        for k, r in rows:
            text = (f"    {k:10s} {size_text(r['bytes'].a):>11s} -> {size_text(r['bytes'].b):>11s}"
                    f" {_signed(r['bytes'].delta, size_text):>12s}   "
                    f"x{r['count'].a:.0f} -> x{r['count'].b:.0f}")
            if "seconds" in r:
                s = r["seconds"]
                text += f"   {_ms(s.a)} -> {_ms(s.b)} ({_signed(s.delta, _ms)})"
            lines.append(text)
    lines += _section("parameters", f"of {d.sizes['params'][0]} change layout", d.params, limit)
    lines += _section("inputs", "change layout", d.inputs, limit)
    lines += _section("ops", f"of {d.sizes['nodes'][0]} change strategy", d.nodes, limit,
                      two_lines=True)
    ca, cb = d.sizes["collectives"]
    lines += _section("collectives", f"differ (a runs {ca} per step, b {cb})", d.collectives,
                      limit, legend="bytes per rank, a -> b: 'of' the value that moves, 'for' "
                                    "the op that reads it")
    for side in ("a", "b"):
        for what, names in d.only_in.get(side, {}).items():
            if names:
                lines.append(f"  {what} only in {d.names['ab'.index(side)]}: {len(names)}, e.g. "
                             + ", ".join(names[:3]))
    return "\n".join(lines)


def _section(title: str, verb: str, changes: tuple[Change, ...], limit: int, *,
             two_lines: bool = False, legend: str = "") -> list[str]:
    if not changes:
        return []
    count = sum(len(c.names) for c in changes)
    lines = [f"  {title}: {count} {verb}" + (f", in {len(changes)} lines"
                                              if len(changes) != count else "")
             + (f" ({legend})" if legend else "")]
    shown = changes if limit <= 0 else changes[:limit]
    for c in shown:
        where = f"{c.layers}: " if c.layers else ""
        if two_lines:
            lines += [f"    {where}{c.what}", f"        a: {c.a}", f"        b: {c.b}"]
        else:
            lines.append(f"    {where}{c.what}  {c.a} -> {c.b}")
    if len(shown) < len(changes):
        lines.append(f"    ... {len(changes) - len(shown)} more lines (--limit 0 shows all; "
                     f"--json lists every name)")
    return lines


__all__ = ["Change", "Figure", "PlanDiff", "diff_files", "diff_plans", "render"]
