"""The records a Plan holds (nodes, collectives, host copies, pipeline stages, parameter
state) and the names of its phases and state modes (docs/plan-format.md); the predicted
figures are in plans/prediction.py."""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir import CollectiveKind, OffloadLevel, Phase, Spec, StateMode, spec_str
from autoshard.plans.prediction import StagePrediction
from autoshard.schedules import rank_stages, stage_rank

FORMAT = "autoshard.plan"
VERSION = 2      # 2: the options the plan was made with, and the model's layers
# The phases a plan and the runtime's ledger record, in step order ("replay" is never recorded).
# "pipeline": the point-to-point sends between pipeline stages (activations forward, their
# gradients backward) and the all-reduce that hands the last stage's loss to every rank.
PHASES = tuple(p for p in Phase if p is not Phase.REPLAY)


@dataclass(frozen=True, slots=True)
class NodePlan:
    name: str
    op: str
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    kernel: str | None = None
    # A parameter's placeholder whose ZeRO mode shards its state over some of its replicated
    # mesh axes only (ir.Strategy.state_axes): their positions; None: all of them.
    state_axes: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        d = {"name": self.name, "op": self.op,
             "placements": [spec_str(s) for s in self.outputs],
             "inputs": [spec_str(s) for s in self.inputs]}
        if self.kernel:
            d["kernel"] = self.kernel
        if self.state_axes is not None:
            d["state_axes"] = list(self.state_axes)
        return d


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    kind: CollectiveKind        # a str where a file names another (it describes, steers nothing)
    axes: tuple[str, ...]
    bytes: int
    phase: Phase
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
    placeholder; ``count``: how many times a step makes it (each micro-step of gradient
    accumulation, docs/cost-model.md §7.2)."""

    direction: str
    bytes: int
    phase: Phase
    node: str
    value: str
    count: int = 1

    def to_json(self) -> dict:
        out = {"direction": self.direction, "bytes": self.bytes, "phase": self.phase,
               "node": self.node, "value": self.value}
        if self.count != 1:
            out["count"] = self.count
        return out


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage: its index along the pipeline axis, the model's layers it runs (the
    first stage also runs what comes before the first layer, the last what comes after the last
    one), and its predicted figures (plans/prediction.py ``StagePrediction``)."""

    index: int
    layers: tuple[str, ...]
    predicted: StagePrediction

    def to_json(self) -> dict:
        return {"index": self.index, "layers": list(self.layers),
                "predicted": self.predicted.to_json()}


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
    gradient's and the optimizer state's specs; ``offload``: what is on the host, "none"
    (nothing), "optimizer" (the optimizer state and step: mode "offload") or "parameters" (the
    stored parameter and its gradient too, copied to the device at each use: "offload_params")."""

    mode: StateMode
    grad: Spec
    optimizer: Spec
    offload: OffloadLevel = OffloadLevel.NONE


# What each state mode keeps on the host (ParamState.offload); the others keep nothing there.
MODE_OFFLOAD = {StateMode.OFFLOAD: OffloadLevel.OPTIMIZER,
                StateMode.OFFLOAD_PARAMS: OffloadLevel.PARAMETERS}

# How summary() names each state mode (cost/state.py).
MODE_NAMES = {StateMode.ZERO1: "ZeRO-1 (optimizer state sharded)",
              StateMode.ZERO2: "ZeRO-2 (gradients and optimizer state sharded)",
              StateMode.OFFLOAD: "optimizer state and step on the host (offload)",
              StateMode.OFFLOAD_PARAMS: "parameters, gradients and optimizer state on the host, "
                                "copied in at each use (parameter offload)"}
