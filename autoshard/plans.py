"""The Plan: a frozen, versioned, JSON-serialisable record of every decision and its price.

It is the only thing that crosses from planning to execution. The format is documented in
docs/plan-format.md. Loading a plan parses JSON and nothing else: it never executes code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir import Layer, Spec, Strategy, parse_spec, spec_str, work_fraction
from autoshard.options import PlanOptions

FORMAT = "autoshard.plan"
VERSION = 2      # 2: the options the plan was made with, and the model's layers
PHASES = ("forward", "backward", "grad_sync", "optimizer")


@dataclass(frozen=True, slots=True)
class NodePlan:
    name: str
    op: str
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    kernel: str | None = None

    def to_json(self) -> dict:
        d = {"name": self.name, "op": self.op,
             "placements": [spec_str(s) for s in self.outputs],
             "inputs": [spec_str(s) for s in self.inputs]}
        if self.kernel:
            d["kernel"] = self.kernel
        return d


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    kind: str
    axes: tuple[str, ...]
    bytes: int
    phase: str
    node: str
    value: str = ""      # the node whose output moves (a parameter's placeholder for grad_sync)

    def to_json(self) -> dict:
        return {"kind": self.kind, "axes": list(self.axes), "bytes": self.bytes,
                "phase": self.phase, "node": self.node, "value": self.value}


@dataclass(frozen=True)
class Plan:
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    cluster: str
    fingerprint: str
    options: PlanOptions
    nodes: tuple[NodePlan, ...]
    params: dict[str, Spec]
    inputs: dict[str, Spec]
    collectives: tuple[CollectiveRecord, ...]
    predicted: dict[str, float]
    solver: dict[str, Any]
    model: str = ""
    node_sigs: dict[str, str] = field(default_factory=dict)
    # Global shape and dtype of each model input, so a plan file can be run without example inputs.
    input_meta: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    # The model's repeated layers in order (trace/layers.py), for per-layer choices and stages.
    layers: tuple[Layer, ...] = ()
    # Wall-clock seconds of this run (trace_s, build_s, solve_s): shown by the CLI, never saved,
    # and not part of equality, so that the same planning gives byte-identical files.
    timings: dict[str, float] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.mesh_shape) != len(self.mesh_axes):
            raise AutoshardError("one axis name per mesh dimension in a plan",
                                 got=f"shape {self.mesh_shape}, axes {self.mesh_axes}",
                                 fix="re-create the plan with autoshard.plan")

    @property
    def training(self) -> bool:
        return self.options.training

    # -- views ---------------------------------------------------------------------------
    def strategies(self) -> dict[str, Strategy]:
        """Every node's strategy, with the share of the op's work one rank does."""
        return {n.name: Strategy(n.inputs, n.outputs, n.kernel,
                                 work_fraction(n.inputs, n.outputs, self.mesh_shape))
                for n in self.nodes}

    def bytes_by(self, *, phase: str | None = None, kind: str | None = None) -> int:
        return sum(c.bytes for c in self.collectives
                   if (phase is None or c.phase == phase) and (kind is None or c.kind == kind))

    def summary(self) -> str:
        p, s = self.predicted, self.solver
        dims = "x".join(map(str, self.mesh_shape))
        lines = [f"autoshard plan {self.model or ''} on mesh {dims} ({','.join(self.mesh_axes)}), "
                 f"cluster {self.cluster}, {'training' if self.training else 'inference'}",
                 f"  predicted step {p['step_time_s'] * 1e3:.3f} ms = compute "
                 f"{p['compute_s'] * 1e3:.3f} ms + comm {p['comm_s'] * 1e3:.3f} ms; peak memory "
                 f"{_size(p['peak_memory_bytes'])} per device",
                 f"  solver {s['status']}, {s['variables']} variables, {s.get('decisions', '?')} "
                 f"decisions, gap {s['gap']:.2%}"]
        by: dict[tuple[str, str, tuple[str, ...]], list[int]] = {}
        for c in self.collectives:
            by.setdefault((c.phase, c.kind, c.axes), []).append(c.bytes)
        lines.append("  collectives:")
        for (phase, kind, axes), bs in sorted(by.items()):
            lines.append(f"    {phase:9s} {kind:14s} over {','.join(axes):8s} x{len(bs):<5d} "
                         f"{_size(sum(bs)):>12s}")
        shown: dict[str, str] = {}
        for fqn, spec in self.params.items():
            shown.setdefault(spec_str(spec), fqn)
        lines.append("  parameter layouts (first parameter of each):")
        for spec, fqn in shown.items():
            n = sum(1 for s in self.params.values() if spec_str(s) == spec)
            lines.append(f"    {spec:20s} x{n:<4d} e.g. {fqn}")
        lines += self.layers_summary()
        return "\n".join(lines)

    def layers_summary(self) -> list[str]:
        """The layers found, one line per run of identical layers of a container."""
        if not self.layers:
            return ["  layers: none found (no module path with a numbered block)"]
        lines = [f"  layers: {len(self.layers)}"]
        runs: list[list[Layer]] = []
        for layer in self.layers:
            last = runs[-1][-1] if runs else None
            if last is not None and layer.same_as == last.same_as and \
                    layer.name.rsplit(".", 1)[0] == last.name.rsplit(".", 1)[0]:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        for run in runs:
            first, last = run[0], run[-1]
            names = first.name if len(run) == 1 else f"{first.name} .. {last.name.rsplit('.', 1)[1]}"
            same = ", identical (decided once)" if len(run) > 1 else ""
            lines.append(f"    {names:32s} x{len(run):<4d} {len(first.nodes)} nodes each{same}")
        return lines

    def explain(self) -> str:
        """One line per node: the strategy it runs."""
        strategies = self.strategies()
        return "\n".join(f"{n.name:40s} {n.op:45s} {strategies[n.name]}" for n in self.nodes)

    # -- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "model": self.model,
            "mesh": {"shape": list(self.mesh_shape), "axes": list(self.mesh_axes),
                     "cluster": self.cluster},
            "fingerprint": self.fingerprint, "options": self.options.to_json(),
            "layers": [{"name": l.name, "same_as": l.same_as, "nodes": list(l.nodes)}
                       for l in self.layers],
            "nodes": [n.to_json() for n in self.nodes],
            "params": {k: {"placements": spec_str(v)} for k, v in self.params.items()},
            "inputs": {k: {"placements": spec_str(v),
                           **({"shape": list(self.input_meta[k][0]), "dtype": self.input_meta[k][1]}
                              if k in self.input_meta else {})}
                       for k, v in self.inputs.items()},
            "collectives": [c.to_json() for c in self.collectives],
            "predicted": self.predicted, "solver": self.solver,
            "node_signatures": self.node_sigs,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps())

    @classmethod
    def loads(cls, text: str, *, source: str = "<string>") -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise AutoshardError("a plan file is JSON written by Plan.save", got=f"{source}: {e}",
                                 fix="re-create it with `autoshard plan ... -o plan.json`") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise AutoshardError(f"a plan file with \"format\": \"{FORMAT}\"", got=f"{source}: {got!r}",
                                 fix="pass a file written by Plan.save / `autoshard plan -o`")
        if d.get("version") != VERSION:
            raise AutoshardError(f"plan format version {VERSION}", got=f"{source}: {d.get('version')!r}",
                                 fix="re-plan with this version of autoshard")
        try:
            return cls._from_dict(d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, AutoshardError):
                raise
            raise AutoshardError("a complete plan (mesh, nodes, params, collectives, predicted, "
                                 "solver)", got=f"{source}: malformed ({type(e).__name__}: {e})",
                                 fix="re-create the plan; do not edit plan files by hand") from e

    @classmethod
    def _from_dict(cls, d: dict) -> "Plan":
        nodes = tuple(NodePlan(n["name"], n["op"], tuple(parse_spec(s) for s in n["inputs"]),
                               tuple(parse_spec(s) for s in n["placements"]), n.get("kernel"))
                      for n in d["nodes"])
        colls = tuple(CollectiveRecord(c["kind"], tuple(c["axes"]), int(c["bytes"]), c["phase"],
                                       c["node"], c.get("value", "")) for c in d["collectives"])
        return cls(mesh_shape=tuple(int(x) for x in d["mesh"]["shape"]),
                   mesh_axes=tuple(d["mesh"]["axes"]), cluster=d["mesh"].get("cluster", ""),
                   fingerprint=d["fingerprint"], options=PlanOptions.from_json(d["options"]),
                   layers=tuple(Layer(l["name"], tuple(l["nodes"]), l["same_as"])
                                for l in d["layers"]),
                   nodes=nodes,
                   params={k: parse_spec(v["placements"]) for k, v in d["params"].items()},
                   inputs={k: parse_spec(v["placements"]) for k, v in d["inputs"].items()},
                   input_meta={k: (tuple(int(x) for x in v["shape"]), str(v["dtype"]))
                               for k, v in d["inputs"].items() if "shape" in v},
                   collectives=colls, predicted=dict(d["predicted"]), solver=dict(d["solver"]),
                   model=d.get("model", ""), node_sigs=dict(d.get("node_signatures", {})))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise AutoshardError("a readable plan file", got=f"{path}: {e.strerror}",
                                 fix="check the path, or make one with `autoshard plan -o`") from e
        return cls.loads(text, source=str(path))

    def check_matches(self, fingerprint: str, node_sigs: dict[str, str], *, what: str = "model") -> None:
        """Refuse a plan made for another graph, naming the first differing nodes."""
        if fingerprint == self.fingerprint:
            return
        diffs = []
        names = list(dict.fromkeys(list(self.node_sigs) + list(node_sigs)))
        for n in names:
            a, b = self.node_sigs.get(n), node_sigs.get(n)
            if a != b:
                diffs.append(f"{n}: plan has {a or '(none)'}, {what} has {b or '(none)'}")
            if len(diffs) == 3:
                break
        raise AutoshardError(f"a plan made for this {what} (fingerprint {fingerprint})",
                             got=f"a plan for fingerprint {self.fingerprint}; first differences: "
                                 + "; ".join(diffs or ["(the plan has no node signatures)"]),
                             fix="re-plan for this model and these input shapes")

    def example_inputs(self, device: Any = "cpu") -> tuple:
        """Zero tensors of the planned input shapes and dtypes: enough to trace the model again."""
        import torch
        dtypes = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32,
                  "bfloat16": torch.bfloat16, "float16": torch.float16, "bool": torch.bool,
                  "float64": torch.float64}
        missing = [k for k in self.inputs if k not in self.input_meta or
                   self.input_meta[k][1] not in dtypes]
        if missing:
            raise AutoshardError("a plan that records every input's shape and dtype",
                                 got=f"none recorded for {missing}",
                                 fix="pass example_inputs=... to parallelize")
        return tuple(torch.zeros(self.input_meta[k][0], dtype=dtypes[self.input_meta[k][1]],
                                 device=device) for k in self.inputs)

    def check_mesh(self, shape: tuple[int, ...], axes: tuple[str, ...]) -> None:
        if tuple(shape) != self.mesh_shape or tuple(axes) != self.mesh_axes:
            raise AutoshardError(f"the mesh the plan was made for: {self.mesh_shape} {self.mesh_axes}",
                                 got=f"mesh {tuple(shape)} {tuple(axes)}",
                                 fix="use the plan's mesh, or re-plan for this mesh")


def _size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1: a tiny model's plan must not
    read "0.00 GiB" (and its snapshot must show a change in memory or traffic)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
