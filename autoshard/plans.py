"""The Plan: a frozen, versioned, JSON-serialisable record of every decision and its price.

It is the only thing that crosses from planning to execution. The format is documented in
docs/plan-format.md. Loading a plan parses JSON and nothing else: it never executes code.
"""
from __future__ import annotations

import json
import re
import reprlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from autoshard.cluster import PRESETS, Cluster
from autoshard.schedules import SCHEDULES, balanced_bubble, rank_stages, stage_rank
from autoshard.errors import AutoshardError
from autoshard.ir import (Layer, Spec, Strategy, parse_spec, replicated, spec_fits, spec_str,
                          work_fraction)
from autoshard.options import PlanOptions
from autoshard.plangraph import graph_of

FORMAT = "autoshard.plan"
VERSION = 2      # 2: the options the plan was made with, and the model's layers
# "recompute": a checkpointed layer's forward collectives, run again in backward.
PHASES = ("forward", "backward", "grad_sync", "optimizer", "recompute", "pipeline")
# "pipeline": the point-to-point sends between pipeline stages (activations forward, their
# gradients backward) and the all-reduce that hands the last stage's loss to every rank.


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
    # A gradient bucket (node "bucket<k>"): the parameters' placeholders whose gradients it
    # all-reduces together, in the order they become ready.
    members: tuple[str, ...] = ()
    # On a pipeline (Plan.pipeline): the stage whose ranks run it (-1: every rank) and how many
    # times per step (once per microbatch for the stage's own collectives).
    stage: int = -1
    count: int = 1

    def to_json(self) -> dict:
        out = {"kind": self.kind, "axes": list(self.axes), "bytes": self.bytes,
               "phase": self.phase, "node": self.node, "value": self.value}
        if self.members:
            out["members"] = list(self.members)
        if self.stage >= 0:
            out["stage"] = self.stage
        if self.count != 1:
            out["count"] = self.count
        return out


# The two directions of the host link (docs/cost-model.md §9): device to host, host to device.
DIRECTIONS = ("d2h", "h2d")


@dataclass(frozen=True, slots=True)
class HostTransfer:
    """One copy over the host link per step (optimizer and parameter offload): ``direction``
    "d2h" (device to host) or "h2d"; ``bytes``; ``phase`` as a collective's ("forward",
    "recompute", "backward", "grad_sync", "optimizer"); ``node``: where it runs (the op whose
    use copies a parameter in, a gradient bucket, or "optimizer"); ``value``: the parameter's
    placeholder."""

    direction: str
    bytes: int
    phase: str
    node: str
    value: str

    def to_json(self) -> dict:
        return {"direction": self.direction, "bytes": self.bytes, "phase": self.phase,
                "node": self.node, "value": self.value}


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage: its index along the pipeline axis, the model's layers it runs (the
    first stage also runs what comes before the first layer, the last what comes after the last
    one), and its predicted figures per step: ``compute_s`` and ``comm_s`` of one microbatch,
    ``ilp_memory_bytes`` (the sum of its state and what forward saves, not a liveness peak)
    with the schedule's microbatches in flight."""

    index: int
    layers: tuple[str, ...]
    predicted: dict[str, float]

    def to_json(self) -> dict:
        return {"index": self.index, "layers": list(self.layers), "predicted": self.predicted}


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A pipelined plan (docs/cost-model.md §10): the mesh axis along which consecutive stages
    lie, the schedule (torch.distributed.pipelining's class name), the number of microbatches
    the batch is cut into, and the stages. Every node's spec is replicated over ``axis``: each
    stage's ranks run their part of the graph as the other axes say."""

    axis: str
    schedule: str
    microbatches: int
    stages: tuple[Stage, ...]
    virtual_stages: int = 1

    @property
    def ranks(self) -> int:
        """The coordinates of the pipeline axis, ``p``."""
        return len(self.stages) // self.virtual_stages

    def stages_of(self, coord: int) -> tuple[int, ...]:
        """The stages coordinate ``coord`` of the pipeline axis runs: ``coord``, ``coord + p``,
        ... (torch.distributed.pipelining's loop placement, ``p`` ranks), or ``coord`` and
        ``2p - 1 - coord`` under a V-placed schedule (autoshard/schedules.py ``rank_stages``)."""
        return rank_stages(self.schedule, self.ranks, coord)

    def rank_of(self, stage: int) -> int:
        """The coordinate of the pipeline axis that runs stage ``stage``."""
        return stage_rank(self.schedule, self.ranks, stage)

    def to_json(self) -> dict:
        return {"axis": self.axis, "schedule": self.schedule, "microbatches": self.microbatches,
                "virtual_stages": self.virtual_stages,
                "stages": [s.to_json() for s in self.stages]}


@dataclass(frozen=True, slots=True)
class ParamState:
    """Where a parameter's gradient and optimizer state live when not with the parameter
    (docs/cost-model.md §9): ``mode`` "zero1", "zero2", "offload" or "offload_params"; the
    gradient's and the optimizer state's specs; ``offload``: what is on the host, "" (nothing),
    "optimizer" (the optimizer state and step: mode "offload") or "parameters" (the stored
    parameter and its gradient too, copied to the device at each use: "offload_params")."""

    mode: str
    grad: Spec
    optimizer: Spec
    offload: str = ""


@dataclass(frozen=True)
class Plan:
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    # The figures the plan was priced on, which every tool prices it again on (a profile's, not
    # only its base preset's name). A name alone only from a file written before plans recorded
    # figures, naming no preset: see priced_on().
    cluster: Cluster | str
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
    # A tied weight (one tensor under several names) -> every layout an op reads it in.
    tied: dict[str, tuple[Spec, ...]] = field(default_factory=dict)
    # What the user should know about the plan: devices repeating work, ops without a rule.
    warnings: tuple[str, ...] = ()
    # Layer name -> activation checkpointing policy ("selective" or "full"), for the layers that
    # recompute.
    recompute: dict[str, str] = field(default_factory=dict)
    # Parameter fqn -> where its gradient and optimizer state live, for the parameters whose
    # state is not laid out as the parameter is (ZeRO-1/2, offload).
    param_state: dict[str, ParamState] = field(default_factory=dict)
    # Every copy over the host link per step (optimizer and parameter offload).
    host_transfers: tuple[HostTransfer, ...] = ()
    # The pipeline stages, when the plan pipelines over a mesh axis (options.pipeline).
    pipeline: Pipeline | None = None
    # Groups of mesh axes (names, in mesh order) whose collectives run as one collective over
    # their joint process group, priced on the slowest member's link (docs/cost-model.md §1.4):
    # a plan made with those axes merged. Empty: every collective runs over one axis.
    joint_axes: tuple[tuple[str, ...], ...] = ()
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

    def settled_options(self) -> PlanOptions:
        """The options with the pipeline as found ("auto" settled to the plan's axis and
        microbatches, or to none): tracing with them gives the graph the plan was made for
        (solver/planner.py trace_for)."""
        if self.pipeline is None:
            return self.options.replace(pipeline=None)
        return self.options.replace(pipeline=self.pipeline.axis,
                                    microbatches=self.pipeline.microbatches)

    @property
    def cluster_name(self) -> str:
        return self.cluster.name if isinstance(self.cluster, Cluster) else self.cluster

    @property
    def cluster_text(self) -> str:
        """The cluster in one line: a preset's name, or a profile's name and the figures in
        which it differs from the preset of that name."""
        if isinstance(self.cluster, Cluster):
            return self.cluster.describe()
        return f"{self.cluster} (its figures not recorded)"

    def priced_on(self, profile: "Cluster | str | Path | None" = None) -> Cluster:
        """The cluster the plan was priced on, for a tool to price it again on: the figures it
        records. ``profile`` (a profile JSON or a Cluster) is only for a file written before
        plans recorded figures whose cluster names no preset; given for a plan that records
        figures, it must hold the same ones."""
        if profile is not None:
            given = Cluster.resolve(profile)
            if isinstance(self.cluster, Cluster) and given != self.cluster:
                raise AutoshardError(
                    "the cluster the plan was priced on; the plan records its figures",
                    got=f"{given.describe()}, the plan was priced on {self.cluster.describe()}",
                    fix="drop --cluster (the plan's own figures are used), or re-plan on "
                        "that cluster")
            if isinstance(self.cluster, str) and given.name != self.cluster:
                raise AutoshardError(f"the cluster the plan was priced on ({self.cluster!r})",
                                     got=f"cluster {given.name!r}",
                                     fix="pass --cluster with the profile the plan was made with")
            return given
        if isinstance(self.cluster, Cluster):
            return self.cluster
        raise AutoshardError(f"the figures of the cluster the plan was priced on "
                             f"({self.cluster!r})",
                             got="a plan file written before plans recorded them, naming no "
                                 "preset",
                             fix="pass --cluster with the profile JSON the plan was made with, "
                                 "or re-plan")

    def mesh(self, profile: "Cluster | str | Path | None" = None):
        """The mesh the plan was priced on: its shape and axes on :meth:`priced_on`'s cluster."""
        from autoshard.mesh import Mesh
        return Mesh(self.mesh_shape, self.mesh_axes, cluster=self.priced_on(profile))

    # -- views ---------------------------------------------------------------------------
    def strategies(self) -> dict[str, Strategy]:
        """Every node's strategy, with the share of the op's work one rank does."""
        return {n.name: Strategy(n.inputs, n.outputs, n.kernel,
                                 work_fraction(n.inputs, n.outputs, self.mesh_shape))
                for n in self.nodes}

    def joint_groups(self) -> tuple[tuple[int, ...], ...]:
        """``joint_axes`` as mesh axis indices (cost/comm.py ``reshard``'s ``joint``)."""
        return tuple(tuple(self.mesh_axes.index(a) for a in g) for g in self.joint_axes)

    def bytes_by(self, *, phase: str | None = None, kind: str | None = None) -> int:
        return sum(c.bytes for c in self.collectives
                   if (phase is None or c.phase == phase) and (kind is None or c.kind == kind))

    def _comm_by_axis(self) -> list[str]:
        exposed, hidden = (self.predicted.get(k, {}) for k in PER_AXIS)
        return [f"    comm over {a}: {exposed.get(a, 0.0) * 1e3:.3f} ms exposed, "
                f"{hidden.get(a, 0.0) * 1e3:.3f} ms hidden behind backward"
                for a in self.mesh_axes if exposed.get(a) or hidden.get(a)]

    def summary(self) -> str:
        p, s = self.predicted, self.solver
        dims = "x".join(map(str, self.mesh_shape))
        lines = [f"autoshard plan {self.model or ''} on mesh {dims} ({','.join(self.mesh_axes)}), "
                 f"cluster {self.cluster_text}, {'training' if self.training else 'inference'}",
                 f"  predicted step {p['step_time_s'] * 1e3:.3f} ms = compute "
                 f"{p['compute_s'] * 1e3:.3f} ms + exposed comm "
                 f"{(p['step_time_s'] - p['compute_s'] - p.get('host_s', 0.0)) * 1e3:.3f} ms "
                 f"(of {p['comm_s'] * 1e3:.3f} ms comm)"
                 + (f" + host link {p['host_s'] * 1e3:.3f} ms" if p.get("host_s") else "")
                 + f"; ILP memory sum {_size(p['ilp_memory_bytes'])} per device",
                 *self._comm_by_axis(),
                 f"  solver {s['status']}, {s['variables']} variables, {s.get('decisions', '?')} "
                 f"decisions, gap {s['gap']:.2%}", *self._mesh_search_summary()]
        by: dict[tuple[str, str, tuple[str, ...]], list[int]] = {}
        for c in self.collectives:        # on a pipeline, every stage's, as often as they run
            by.setdefault((c.phase, c.kind, c.axes), []).extend([c.bytes] * c.count)
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
        for fqn, reads in self.tied.items():
            lines.append(f"  tied weight {fqn}: stored {spec_str(self.params[fqn])}, read as "
                         + ", ".join(spec_str(r) for r in reads))
        lines += self._state_summary()
        lines += self._pipeline_summary()
        for policy in ("selective", "full"):
            n = sum(1 for p in self.recompute.values() if p == policy)
            if n:
                what = ("their forward in backward" if policy == "full" else
                        "all but matmul, attention and collective outputs in backward")
                lines.append(f"  activation checkpointing ({policy}): {n} of {len(self.layers)} "
                             f"layers recompute {what}")
        lines += self.layers_summary()
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _state_summary(self) -> list[str]:
        """Where gradients and optimizer state live (ZeRO-1/2, offload) and the memory split."""
        lines = []
        by: dict[str, int] = {}
        for st in self.param_state.values():
            by[st.mode] = by.get(st.mode, 0) + 1
        for mode, n in sorted(by.items()):
            lines.append(f"  {MODE_NAMES.get(mode, mode)}: {n} of {len(self.params)} parameters")
        if self.host_transfers:
            by_dir = {d: sum(t.bytes for t in self.host_transfers if t.direction == d)
                      for d in DIRECTIONS}
            host_s = self.predicted.get("host_s")
            lines.append(f"  host link per step: {_size(by_dir['h2d'])} host to device, "
                         f"{_size(by_dir['d2h'])} device to host"
                         + (f"; {host_s * 1e3:.3f} ms of it outside the optimizer step, "
                            f"not overlapped" if host_s else ""))
        mem = self.predicted.get("memory")
        if isinstance(mem, dict):
            parts = ", ".join(f"{k} {_size(mem[k])}" for k in
                              ("parameters", "gradients", "optimizer", "activations",
                               "temporaries") if mem.get(k))
            host = f"; host {_size(mem['host'])}" if mem.get("host") else ""
            at = self.predicted.get("peak_phase")
            peak = f" {_size(mem['peak'])}" if "peak" in mem else ""
            lines.append(f"  peak over the step (liveness){peak}{f', in {at}' if at else ''}: "
                         f"{parts}{host}")
        if self.predicted.get("optimizer_s"):
            lines.append(f"  optimizer step: {self.predicted['optimizer_s'] * 1e3:.3f} ms "
                         f"(in compute)")
        return lines

    def _mesh_search_summary(self) -> list[str]:
        """The meshes a ``--gpus`` search tried (solver/meshes.py), fastest first."""
        ms = self.solver.get("mesh_search")
        if not ms:
            return []
        lines = [f"  mesh search over {ms['gpus']} devices ({ms['gpus_per_node']} per node): "
                 f"{len(ms['tried'])} of {ms['candidates']} meshes planned in "
                 f"{ms['search_s']:.1f} s"]
        for t in ms["tried"]:
            mesh = f"{'x'.join(map(str, t['mesh']))} ({','.join(t['axes'])})"
            what = (f"{t['step_time_s'] * 1e3:.3f} ms" + (
                f", {t['schedule']}, {t['microbatches']} microbatches" if t.get("microbatches")
                else "") if "step_time_s" in t else f"no plan: {t.get('error', '')[:90]}")
            lines.append(f"    {mesh:22s} {what}{'  <- chosen' if t.get('chosen') else ''}")
        if ms["not_tried"]:
            lines.append(f"    not planned ({ms['not_tried'][0]['not_tried']}): " + ", ".join(
                "x".join(map(str, t["mesh"])) + f" ({','.join(t['axes'])})"
                for t in ms["not_tried"]))
        return lines

    def _pipeline_summary(self) -> list[str]:
        pl = self.pipeline
        lines = []
        search = self.solver.get("pipeline_search")
        if search:
            chosen = pl.axis if pl else None
            parts = [f"{t['pipeline'] or 'none'} " + (
                f"{t['step_time_s'] * 1e3:.3f} ms" + (f" ({t['microbatches']} microbatches)"
                                                      if t.get("microbatches") else "")
                if t["step_time_s"] is not None else f"no plan: {t.get('error', '')[:80]}")
                + (" <- chosen" if t["pipeline"] == chosen else "") for t in search]
            lines.append("  pipeline search (pipeline='auto'): " + "; ".join(parts))
        if pl is None:
            return lines
        v, m = pl.virtual_stages, pl.microbatches
        p = len(pl.stages) // v
        lines.append(f"  pipeline over {pl.axis}: {pl.schedule}, {m} microbatches, "
                     f"{len(pl.stages)} stages on {p} ranks "
                     f"(bubble {balanced_bubble(pl.schedule, p, m):.0%} when balanced)")
        for st in pl.stages:
            what = (f"{st.layers[0]} .. {st.layers[-1].rsplit('.', 1)[-1]}" if len(st.layers) > 1
                    else (st.layers[0] if st.layers else "no layer"))
            lines.append(f"    stage {st.index}: {what} ({len(st.layers)} layers); per microbatch "
                         f"compute {st.predicted['compute_s'] * 1e3:.3f} ms + comm "
                         f"{st.predicted['comm_s'] * 1e3:.3f} ms; ILP memory sum "
                         f"{_size(st.predicted['ilp_memory_bytes'])}")
        return lines

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
                     "cluster": self.cluster.to_json() if isinstance(self.cluster, Cluster)
                     else self.cluster},
            "fingerprint": self.fingerprint, "options": self.options.to_json(),
            "layers": [{"name": l.name, "same_as": l.same_as, "nodes": list(l.nodes)}
                       for l in self.layers],
            "nodes": [n.to_json() for n in self.nodes],
            "tied": {k: [spec_str(r) for r in v] for k, v in self.tied.items()},
            "warnings": list(self.warnings), "recompute": dict(self.recompute),
            "params": {k: self._param_json(k) for k in self.params},
            "inputs": {k: {"placements": spec_str(v),
                           **({"shape": list(self.input_meta[k][0]), "dtype": self.input_meta[k][1]}
                              if k in self.input_meta else {})}
                       for k, v in self.inputs.items()},
            "collectives": [c.to_json() for c in self.collectives],
            **({"host_transfers": [t.to_json() for t in self.host_transfers]}
               if self.host_transfers else {}),
            "predicted": self.predicted, "solver": self.solver,
            "node_signatures": self.node_sigs,
            **({"pipeline": self.pipeline.to_json()} if self.pipeline else {}),
            **({"joint_axes": [list(g) for g in self.joint_axes]} if self.joint_axes else {}),
        }

    def _param_json(self, fqn: str) -> dict:
        spec = self.params[fqn]
        st = self.param_state.get(fqn)
        return {"placements": spec_str(spec),
                "grad_placements": spec_str(st.grad if st else spec),
                "optimizer_placements": spec_str(st.optimizer if st else spec),
                "offload": st.offload if st and st.offload else False}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the plan file, atomically (autoshard/files.py)."""
        from autoshard.files import write_output
        write_output(path, self.dumps(), what="plan")

    @classmethod
    def loads(cls, text: str, *, source: str = "<string>") -> "Plan":
        try:
            d = json.loads(text)
        # ValueError: bad JSON, or an integer of over 4300 digits; RecursionError: deep nesting.
        except (ValueError, RecursionError) as e:
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
            plan = cls._from_dict(d)
        except _Malformed as e:
            raise AutoshardError("a complete plan (mesh, nodes, params, collectives, predicted, "
                                 f"solver), with {e.where} {e.expected}",
                                 got=f"{source}: malformed, {e.got}",
                                 fix=f"correct {e.where} as docs/plan-format.md describes it, "
                                     f"or re-create the plan with `autoshard plan -o`") from e
        _check_layouts(plan, source)
        return plan

    @classmethod
    def _from_dict(cls, d: dict) -> "Plan":
        """Every value is checked as it is read (docs/plan-format.md), so that a hand-edited or
        damaged file is refused here, naming the value, and not later inside summary(),
        planning or the runtime."""
        root = _Field(d, "")
        shape, axes, cluster = _read_mesh(root.key("mesh"))
        nodes = _read_nodes(root.key("nodes"), len(shape))
        inputs = _read_inputs(root.key("inputs"), shape)
        params = {k: f.key("placements").spec(len(shape)) for k, f in root.key("params").items()}
        param_state = _read_param_state(root.key("params"), params, nodes, len(shape))
        layers = _read_layers(root.key("layers"), {n.name for n in nodes})
        return cls(mesh_shape=shape, mesh_axes=axes, cluster=cluster,
                   fingerprint=root.key("fingerprint").text(),
                   options=_read_options(root.key("options")),
                   layers=layers,
                   recompute=_read_recompute(root.key("recompute", {}), layers),
                   nodes=nodes, params=params, param_state=param_state,
                   # Optional: plans written before tied weights and warnings were recorded.
                   tied=_read_tied(root.key("tied", {}), params, len(shape)),
                   warnings=tuple(w.text() for w in root.key("warnings", []).entries()),
                   inputs={k: spec for k, (spec, _) in inputs.items()},
                   input_meta={k: meta for k, (_, meta) in inputs.items() if meta is not None},
                   collectives=tuple(_read_collective(f) for f in root.key("collectives").entries()),
                   # Optional: plans written before host transfers were listed have none.
                   host_transfers=tuple(_read_host_transfer(f) for f in
                                        root.key("host_transfers", []).entries()),
                   predicted=_read_numbers(root.key("predicted"), PREDICTED),
                   solver=_read_solver(root.key("solver")),
                   model=root.key("model", "").text(),
                   node_sigs={k: f.text() for k, f in root.key("node_signatures", {}).items()},
                   pipeline=_read_pipeline(root.key("pipeline", None), axes, layers),
                   joint_axes=_read_joint_axes(root.key("joint_axes", []), axes))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:    # a binary file is not UTF-8 text
            raise AutoshardError("a readable plan file",
                                 got=f"{path}: {getattr(e, 'strerror', None) or e}",
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


# ------------------------------------------------------------------------------ reading a file

# How summary() names each state mode (cost/state.py).
MODE_NAMES = {"zero1": "ZeRO-1 (optimizer state sharded)",
              "zero2": "ZeRO-2 (gradients and optimizer state sharded)",
              "offload": "optimizer state and step on the host (offload)",
              "offload_params": "parameters, gradients and optimizer state on the host, "
                                "copied in at each use (parameter offload)"}
# The figures summary() prints; a plan may carry more.
PREDICTED = ("step_time_s", "compute_s", "comm_s", "ilp_memory_bytes")
# Per mesh axis: communication the step waits for (blocking, and gradient sync that backward
# compute does not hide), and gradient sync hidden behind backward (docs/cost-model.md §7).
PER_AXIS = ("exposed_comm_s", "overlapped_comm_s")
_REQUIRED = object()


class _Malformed(Exception):
    """A missing or ill-typed value of a plan file; ``Plan.loads`` adds the file and the fix."""

    def __init__(self, where: str, expected: str, got: str) -> None:
        super().__init__(f"{where} {expected}; got {got}")
        self.where, self.expected, self.got = where, expected, got


class _Field:
    """One JSON value of a plan file and where it sits (``nodes[3].inputs[0]``), read through a
    check of its kind. JSON puts any type anywhere, bool passes for int and a float may be nan
    or inf: a bad value must fail here, named, not later inside summary() or the runtime."""

    __slots__ = ("value", "where")

    def __init__(self, value: Any, where: str) -> None:
        self.value, self.where = value, where

    def fail(self, expected: str) -> NoReturn:
        raise _Malformed(self.where, expected, f"{self.where} = {reprlib.repr(self.value)}")

    def key(self, name: str, default: Any = _REQUIRED) -> "_Field":
        obj, where = self.obj(), f"{self.where}.{name}".lstrip(".")
        if name not in obj and default is _REQUIRED:
            raise _Malformed(where, "given", f"no key {name!r}")
        return _Field(obj.get(name, default), where)

    def obj(self) -> dict:
        if not isinstance(self.value, dict):
            self.fail("a JSON object")
        return self.value

    def items(self) -> list[tuple[str, "_Field"]]:
        return [(k, _Field(v, f"{self.where}[{k!r}]")) for k, v in self.obj().items()]

    def entries(self, *, nonempty: bool = False) -> list["_Field"]:
        if not isinstance(self.value, list) or (nonempty and not self.value):
            self.fail("a non-empty list" if nonempty else "a list")
        return [_Field(v, f"{self.where}[{i}]") for i, v in enumerate(self.value)]

    def text(self, *, nonempty: bool = False) -> str:
        if not isinstance(self.value, str) or (nonempty and not self.value):
            self.fail("a non-empty string" if nonempty else "a string")
        return self.value

    def integer(self, *, least: int = 0) -> int:
        # Below 2**63, as every size and count is: a huge int overflows float arithmetic.
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int) or not least <= v < 2**63:
            self.fail(f"an integer from {least} to 2**63 - 1")
        return v

    def number(self) -> float:
        # The upper bound refuses inf and an int too large for a float; nan fails both bounds.
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= sys.float_info.max:
            self.fail("a finite number >= 0")
        return v

    def spec(self, ndim: int) -> Spec:
        try:
            spec = parse_spec(self.text())
        except ValueError:          # fail() shows the text; the parser's fix speaks to code
            spec = None
        if spec is None or len(spec) != ndim:
            self.fail(f"a spec with one placement (R, P or S(dim)) per mesh axis, like "
                      f"'{spec_str(replicated(ndim))}'")
        return spec


def _read_mesh(f: _Field) -> tuple[tuple[int, ...], tuple[str, ...], Cluster | str]:
    shape = tuple(n.integer(least=1) for n in f.key("shape").entries(nonempty=True))
    axes_field = f.key("axes")
    axes = tuple(a.text(nonempty=True) for a in axes_field.entries())
    if len(axes) != len(shape) or len(set(axes)) != len(axes):
        axes_field.fail(f"one distinct name per dimension of the mesh shape {list(shape)}")
    return shape, axes, _read_cluster(f.key("cluster", ""))


def _read_cluster(f: _Field) -> Cluster | str:
    """The cluster's figures (docs/plan-format.md). Files written before plans recorded them
    name it: a preset by its name is taken as that preset (what every tool priced such a plan
    on); another name is kept, and a tool that prices the plan asks for its profile."""
    if isinstance(f.value, str):
        return PRESETS.get(f.value, f.value)
    try:
        return Cluster.from_json(f.obj())
    except AutoshardError as e:
        raise _Malformed(f.where, f"the figures of a cluster: {e.expected}", e.got) from e


def _read_nodes(f: _Field, ndim: int) -> tuple[NodePlan, ...]:
    nodes: dict[str, NodePlan] = {}
    for n in f.entries():
        name, kernel = n.key("name"), n.key("kernel", None)
        if name.text(nonempty=True) in nodes:
            name.fail("a node name used once")
        nodes[name.value] = NodePlan(
            name.value, n.key("op").text(),
            tuple(s.spec(ndim) for s in n.key("inputs").entries()),
            tuple(s.spec(ndim) for s in n.key("placements").entries()),
            None if kernel.value is None else kernel.text())
    return tuple(nodes.values())


def _read_inputs(f: _Field, mesh_shape: tuple[int, ...]) -> dict[str, tuple[Spec, Any]]:
    """Each model input's (spec, (shape, dtype) or None), in positional order: the file's keys
    are sorted as text, input10 before input2, and example_inputs() needs them by position."""
    position = {k: _input_position(k, x) for k, x in f.items()}
    if sorted(position.values()) != list(range(len(position))):
        f.fail(f"inputs keyed input0 .. input{len(position) - 1}, one per model input")
    out: dict[str, tuple[Spec, Any]] = {}
    for k, x in sorted(f.items(), key=lambda kv: position[kv[0]]):
        placements = x.key("placements")
        spec = placements.spec(len(mesh_shape))
        if "shape" not in x.obj():
            out[k] = (spec, None)
            continue
        shape = tuple(d.integer(least=1) for d in x.key("shape").entries())
        if not spec_fits(shape, spec, mesh_shape):
            placements.fail(f"a spec that splits the input's shape {list(shape)} evenly")
        out[k] = (spec, (shape, x.key("dtype").text(nonempty=True)))
    return out


def _input_position(name: str, f: _Field) -> int:
    # At most 9 digits: int() of thousands of digits is refused (and no model has that many).
    match = re.fullmatch(r"input([0-9]{1,9})", name)
    if match is None:
        f.fail(f"keyed input<i> (the input's position), not {name!r}")
    return int(match.group(1))


def _read_options(f: _Field) -> PlanOptions:
    try:
        return PlanOptions.from_json(f.obj())
    except AutoshardError as e:      # its fix speaks to code that builds options
        raise _Malformed(f.where, f"valid: {e.expected}", e.got) from e
    except OverflowError as e:       # PlanOptions' finiteness check on an int beyond any float
        raise _Malformed(f.where, "valid: numbers within float range", str(e)) from e


def _read_layers(f: _Field, node_names: set[str]) -> tuple[Layer, ...]:
    layers = []
    for x in f.entries():
        members, name = x.key("nodes"), x.key("name")
        nodes = tuple(n.text() for n in members.entries(nonempty=True))
        if not set(nodes) <= node_names:
            members.fail("names of the plan's nodes")
        # As trace/layers.py names them; summary() splits the block's number off.
        if not re.fullmatch(r".+\.[0-9]+", name.text()):
            name.fail("a module path ending in the block's number, like 'layers.3'")
        layers.append(Layer(name.value, nodes, x.key("same_as").text()))
    names = {layer.name for layer in layers}
    for x, layer in zip(f.entries(), layers):
        if layer.same_as not in names:      # summary() groups identical layers by it
            x.key("same_as").fail("the name of one of the plan's layers")
    return tuple(layers)


def _read_tied(f: _Field, params: dict[str, Spec], ndim: int) -> dict[str, tuple[Spec, ...]]:
    tied = {}
    for fqn, reads in f.items():
        if fqn not in params:      # summary() shows the layout it is stored in
            reads.fail("a tied weight among the plan's params")
        tied[fqn] = tuple(r.spec(ndim) for r in reads.entries())
    return tied


def _read_recompute(f: _Field, layers: tuple[Layer, ...]) -> dict[str, str]:
    names = {layer.name for layer in layers}
    out = {}
    for name, policy in f.items():
        if name not in names:       # the runtime checkpoints the layer by this name
            policy.fail(f"a policy for one of the plan's layers, not {name!r}")
        if policy.text() not in ("selective", "full"):
            policy.fail('"selective" or "full"')
        out[name] = policy.text()
    return out


def _read_collective(f: _Field) -> CollectiveRecord:
    # Kinds, phases and axes are not held to today's lists: they describe a step and steer
    # nothing (verify compares them with the collectives that ran).
    return CollectiveRecord(f.key("kind").text(), tuple(a.text() for a in f.key("axes").entries()),
                            f.key("bytes").integer(), f.key("phase").text(), f.key("node").text(),
                            f.key("value", "").text(),
                            tuple(m.text(nonempty=True) for m in f.key("members", []).entries()),
                            f.key("stage", -1).integer(least=-1),
                            f.key("count", 1).integer(least=1))


def _read_pipeline(f: _Field, axes: tuple[str, ...], layers: tuple[Layer, ...]
                   ) -> Pipeline | None:
    if f.value is None:
        return None
    axis = f.key("axis")
    if axis.text() not in axes:
        axis.fail(f"one of the mesh's axes {list(axes)}")
    schedule = f.key("schedule")
    if schedule.text() not in SCHEDULES:
        schedule.fail(f"one of {', '.join(map(json.dumps, SCHEDULES))}")
    names = {layer.name for layer in layers}
    stages = []
    for i, x in enumerate(f.key("stages").entries(nonempty=True)):
        if x.key("index").integer() != i:
            x.key("index").fail(f"the stage's position, {i}")
        members = x.key("layers")
        stage_layers = tuple(n.text() for n in members.entries())
        if not set(stage_layers) <= names:
            members.fail("names of the plan's layers")
        stages.append(Stage(i, stage_layers, _read_numbers(x.key("predicted"),
                                                           ("compute_s", "comm_s",
                                                            "ilp_memory_bytes"))))
    microbatches = f.key("microbatches")
    m = microbatches.integer(least=1)
    if schedule.value == "DualPipeV" and m < len(stages):
        microbatches.fail(f"at least {len(stages)} under DualPipeV (one per stage, as torch's "
                          f"ScheduleDualPipeV requires)")
    return Pipeline(axis.value, schedule.value, m, tuple(stages),
                    f.key("virtual_stages", 1).integer(least=1))


def _read_param_state(f: _Field, params: dict[str, Spec], nodes: tuple[NodePlan, ...],
                      ndim: int) -> dict[str, ParamState]:
    """Each parameter's gradient and optimizer placements (absent in plans made before they
    were recorded: both follow the parameter). The mode is the parameter's placeholder's kernel
    (docs/plan-format.md); the placements must agree with it."""
    out = {}
    for fqn, pf in f.items():
        spec = params[fqn]
        grad = pf.key("grad_placements", spec_str(spec)).spec(ndim)
        opt = pf.key("optimizer_placements", spec_str(spec)).spec(ndim)
        off = pf.key("offload", False)
        # false, "optimizer" or "parameters"; true in plans written before parameter offload
        # (the optimizer's).
        what = {False: "", True: "optimizer", "optimizer": "optimizer",
                "parameters": "parameters"}.get(off.value) \
            if isinstance(off.value, (bool, str)) else None
        if what is None:
            off.fail('false, "optimizer" or "parameters"')
        if grad == spec and opt == spec and not what:
            continue
        mode = {"optimizer": "offload", "parameters": "offload_params"}.get(what) or (
            "zero2" if grad != spec else "zero1")
        if not what and grad not in (spec, opt):
            pf.key("grad_placements").fail(f"the parameter's placements or its "
                                           f"optimizer_placements {spec_str(opt)}")
        out[fqn] = ParamState(mode, grad, opt, what)
    return out


def _read_host_transfer(f: _Field) -> HostTransfer:
    direction = f.key("direction")
    if direction.text() not in DIRECTIONS:
        direction.fail(f"one of {', '.join(map(json.dumps, DIRECTIONS))}")
    return HostTransfer(direction.value, f.key("bytes").integer(), f.key("phase").text(),
                        f.key("node").text(), f.key("value").text())


# Figures a plan file may carry under an earlier name: read under the new one.
RENAMED = {"peak_memory_bytes": "ilp_memory_bytes"}   # the ILP's memory sum, not a peak


def _read_numbers(f: _Field, keys: tuple[str, ...]) -> dict[str, Any]:
    obj = f.obj()
    for old, new in RENAMED.items():
        if old in obj and new not in obj:
            obj[new] = obj.pop(old)
    for k in keys:
        f.key(k).number()
    for k in ("optimizer_s", "host_s"):     # absent from plans made before they were priced
        if k in f.obj():
            f.key(k).number()
    for k in (*PER_AXIS, "memory"):   # absent from plans made before they were priced
        for x in f.key(k, {}).obj():
            f.key(k).key(x).number()
    return dict(f.obj())


def _read_joint_axes(f: _Field, axes: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Groups of two or more of the mesh's axes, in mesh order, no axis in two groups (absent
    in plans whose collectives all run over one axis)."""
    out: list[tuple[str, ...]] = []
    for g in f.entries():
        names = tuple(a.text() for a in g.entries())
        if len(names) < 2 or any(a not in axes for a in names) or \
                list(names) != sorted(set(names), key=axes.index) or \
                any(a in h for h in out for a in names):
            g.fail(f"a group of two or more of the mesh axes {list(axes)}, in mesh order, "
                   f"in no other group")
        out.append(names)
    return tuple(out)


def _read_solver(f: _Field) -> dict[str, Any]:
    """The solver's record: the fields summary() prints are checked, the rest kept as they are."""
    f.key("status").text()
    f.key("variables").integer()
    f.key("gap").number()
    f.key("decisions", 0).integer()
    return dict(f.obj())

def _check_layouts(plan: Plan, source: str) -> None:
    """Every placement against its tensor (docs/plan-format.md "Which placements run"): each
    spec of a node's outputs and inputs, of a parameter and its gradient and optimizer state, of
    a tied weight's reads, fits the tensor's shape (its node signature) on the mesh: every S(d)
    a dim the tensor has, split evenly. The nodes are what runs: ``params`` repeats each
    parameter's placeholder spec, and its state mode is the placeholder's kernel; a file where
    the two differ (one edited, not the other) is refused, naming both."""
    if not plan.node_sigs:        # older files: nothing to check the specs against
        return
    g = graph_of(plan)
    index = {n.name: i for i, n in enumerate(plan.nodes)}

    def fits(where: str, spec: Spec, shape: tuple[int, ...] | None) -> None:
        if shape is not None and not spec_fits(shape, spec, plan.mesh_shape):
            raise AutoshardError(
                "every placement fits its tensor: each S(d) a dim the tensor has, split evenly "
                "by the mesh axes that shard it",
                got=f"{source}: {where} = {spec_str(spec)!r} for a tensor of shape {list(shape)} "
                    f"on mesh {list(plan.mesh_shape)}",
                fix="shard only dims the tensor has, into equal parts (or re-create the plan "
                    "with `autoshard plan`)")

    for n in plan.nodes:
        at = f"nodes[{index[n.name]}] ({n.name})"
        for k, spec in enumerate(n.outputs):
            fits(f"{at}.placements[{k}]", spec, g.shapes.get((n.name, k)))
        for k, (spec, value) in enumerate(zip(n.inputs, g.reads.get(n.name, ()))):
            fits(f"{at}.inputs[{k}]", spec, g.shapes.get(value))
    for fqn, name in g.param_node.items():
        node, shape = g.nodes[name], g.shapes.get((name, 0))
        st = plan.param_state.get(fqn)
        fits(f"params[{fqn!r}].placements", plan.params[fqn], shape)
        own = node.outputs[0] if node.outputs else ()
        if own != plan.params[fqn] or node.kernel != (st.mode if st else None):
            raise AutoshardError(
                "a parameter's layout in one place: its placeholder node's spec and kernel, "
                "which run, repeated in params",
                got=f"{source}: params[{fqn!r}] has {spec_str(plan.params[fqn])!r}"
                    f"{' (' + st.mode + ')' if st else ''}, its node {name} "
                    f"{spec_str(own) if own else 'with no placement'!r}"
                    f"{' (' + node.kernel + ')' if node.kernel else ''}",
                fix="edit both alike (the node's spec is the one that runs; its readers' "
                    "inputs reshard from it), or re-create the plan with `autoshard plan`")
        for what, spec in (("grad_placements", st.grad if st else None),
                           ("optimizer_placements", st.optimizer if st else None)):
            if spec is not None:
                fits(f"params[{fqn!r}].{what}", spec, shape)
        for k, spec in enumerate(plan.tied.get(fqn, ())):
            fits(f"tied[{fqn!r}][{k}]", spec, shape)


def _size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1: a tiny model's plan must not
    read "0.00 GiB" (and its snapshot must show a change in memory or traffic)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
