"""The Plan: a frozen, versioned, JSON-serialisable record of every decision and its price.

It is the only thing that crosses from planning to execution. The format is documented in
docs/plan-format.md. Loading a plan parses JSON and nothing else: it never executes code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.ir import Layer, OffloadLevel, Phase, Spec, Strategy, spec_str, work_fraction
from autoshard.options import PlanOptions
from autoshard.plans.fileformat import check_layouts, read_fields
from autoshard.plans.prediction import Prediction
from autoshard.plans.records import (CollectiveRecord, FORMAT, HostTransfer, NodePlan, ParamState,
                                     Pipeline, VERSION)
from autoshard.plans.summary import explain, summary


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
    predicted: Prediction
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

    def strategies(self) -> dict[str, Strategy]:
        """Every node's strategy, with the share of the op's work one rank does."""
        return {n.name: Strategy(n.inputs, n.outputs, n.kernel,
                                 work_fraction(n.inputs, n.outputs, self.mesh_shape),
                                 n.state_axes)
                for n in self.nodes}

    def joint_groups(self) -> tuple[tuple[int, ...], ...]:
        """``joint_axes`` as mesh axis indices (cost/comm.py ``reshard``'s ``joint``)."""
        return tuple(tuple(self.mesh_axes.index(a) for a in g) for g in self.joint_axes)

    def bytes_by(self, *, phase: Phase | None = None, kind: str | None = None) -> int:
        return sum(c.bytes for c in self.collectives
                   if (phase is None or c.phase == phase) and (kind is None or c.kind == kind))

    def summary(self) -> str:
        """The plan in words: the step, its parts, memory, state, mesh search, pipeline, layers
        (plans/summary.py)."""
        return summary(self)

    def explain(self) -> str:
        """One line per node: the strategy it runs."""
        return explain(self)

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
            "predicted": self.predicted.to_json(), "solver": self.solver,
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
                # Nothing on the host is written false, as plan files always have.
                "offload": st.offload if st and st.offload != OffloadLevel.NONE else False}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the plan file, atomically (autoshard/files.py)."""
        from autoshard.files import write_output
        write_output(path, self.dumps(), what="plan")

    @classmethod
    def loads(cls, text: str, *, source: str = "<string>") -> "Plan":
        """A plan from the text of a plan file, every value checked (plans/fileformat.py)."""
        plan = cls(**read_fields(text, source))
        check_layouts(plan, source)
        return plan

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
