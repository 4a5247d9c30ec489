"""A plan's predicted figures (docs/plan-format.md, ``predicted``), typed: the step and its
parts, the memory the ILP bounds, the peak over the step and what is alive then, and the
communication per mesh axis; and a pipeline stage's. They are written to the plan file as
``to_json()`` gives them and read back by ``from_json()``, each value checked, so that a plan
saved, loaded and saved again is the same file.

A number keeps the type the pricing gave it (an int stays an int): the file writes ``0`` and
``0.0`` apart, and the figures are compared as the file holds them."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from autoshard.ir import Phase
from autoshard.plans.fields import Field

# The phases a step's memory can peak in (cost/liveness.py).
PEAK_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
# A figure a plan file may carry under an earlier name, read under the new one: the ILP's memory
# sum was once called a peak, which it is not.
RENAMED = {"peak_memory_bytes": "ilp_memory_bytes"}


@dataclass(frozen=True)
class PredictedMemory:
    """One device's memory over the step, in bytes (docs/cost-model.md §4.5): ``peak``, the most
    it holds at once, from the liveness of values, and what is alive then (``parameters``,
    buffers included; ``gradients``; ``optimizer`` state; ``activations``; ``temporaries``);
    ``model_state``, the parameters, gradients and optimizer state on the device in total;
    ``host``, the bytes offloaded to the host with their pinned buffers, not in the peak."""

    peak: float
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    temporaries: float
    host: float
    model_state: float

    def to_json(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def read(cls, f: Field) -> "PredictedMemory":
        _known_keys(f, [x.name for x in fields(cls)])
        return cls(**{x.name: f.key(x.name).number() for x in fields(cls)})


@dataclass(frozen=True)
class Prediction:
    """The cost model's figures for one device and one step (docs/plan-format.md):

    - ``step_time_s``: compute, the communication the step waits for and ``host_s``;
    - ``compute_s`` (``optimizer_s`` in it), ``comm_s`` (every collective's seconds, hidden or
      not), ``optimizer_s`` (the optimizer step, its host copies included), ``host_s`` (copies of
      parameters kept on the host, outside the optimizer step; 0: none), ``host_step_s`` (the
      host's optimizer step under offload, run in the overlap window; 0: none);
    - ``ilp_sum_bytes``: the sum the ILP bounds (parameter state and what forward saves, each
      saved value once per layout), not the step's peak (``memory.peak``); on disk
      ``ilp_memory_bytes``; on a pipeline, the largest of the ranks' stage sums;
    - ``peak_phase`` and ``memory``: the peak over the step and its parts; None on a pipelined
      plan, whose stages carry their own peaks (``StagePrediction.peak_bytes``);
    - ``exposed_comm_s`` and ``overlapped_comm_s``: per mesh axis, the seconds the step waits
      for and the gradient sync hidden behind backward (None: a plan made before overlap was
      priced). On a pipeline, the pipeline axis's exposed seconds are the rest of what the step
      waits for beyond compute (its sends, the bubble's share of them, the loss's all-reduce)."""

    step_time_s: float
    compute_s: float
    comm_s: float
    ilp_sum_bytes: float
    optimizer_s: float = 0.0
    host_s: float = 0.0
    host_step_s: float = 0.0
    peak_phase: Phase | None = None
    memory: PredictedMemory | None = None
    exposed_comm_s: dict[str, float] | None = None
    overlapped_comm_s: dict[str, float] | None = None

    @property
    def peak_bytes(self) -> float:
        """The step's liveness peak, or where the plan has no memory walk (a pipeline's) the
        sum the ILP bounds."""
        return self.memory.peak if self.memory is not None else self.ilp_sum_bytes

    @property
    def exposed_comm_total_s(self) -> float:
        """The communication the step waits for: the step less compute and the host link."""
        return self.step_time_s - self.compute_s - self.host_s

    def to_json(self) -> dict[str, Any]:
        """The ``predicted`` object of a plan file, its keys in the order plans have always
        written them; ``host_s``, ``host_step_s`` only when not 0, the others only when set."""
        out: dict[str, Any] = {"step_time_s": self.step_time_s, "compute_s": self.compute_s}
        if self.host_s:
            out["host_s"] = self.host_s
        out.update(comm_s=self.comm_s, ilp_memory_bytes=self.ilp_sum_bytes,
                   optimizer_s=self.optimizer_s)
        if self.peak_phase is not None:
            out["peak_phase"] = self.peak_phase
        if self.host_step_s:
            out["host_step_s"] = self.host_step_s
        if self.memory is not None:
            out["memory"] = self.memory.to_json()
        for k in ("exposed_comm_s", "overlapped_comm_s"):
            if getattr(self, k) is not None:
                out[k] = dict(getattr(self, k))
        return out

    @classmethod
    def from_json(cls, d: Any, where: str = "predicted") -> "Prediction":
        """The figures of a plan file's ``predicted`` object; a missing, unknown or ill-typed
        value raises ``Malformed`` (an AutoshardError) naming it."""
        return cls.read(Field(d, where))

    @classmethod
    def read(cls, f: Field) -> "Prediction":
        obj = _renamed(f)
        _known_keys(f, _KEYS)
        # Optional: absent from plans made before they were priced (and, for the memory and its
        # phase, from a pipelined plan's).
        phase = f.key("peak_phase", None)
        memory = f.key("memory", None)
        return cls(step_time_s=f.key("step_time_s").number(),
                   compute_s=f.key("compute_s").number(), comm_s=f.key("comm_s").number(),
                   ilp_sum_bytes=obj.key("ilp_memory_bytes").number(),
                   optimizer_s=f.key("optimizer_s", 0.0).number(),
                   host_s=f.key("host_s", 0.0).number(),
                   host_step_s=f.key("host_step_s", 0.0).number(),
                   peak_phase=None if phase.value is None else phase.one_of(PEAK_PHASES),
                   memory=None if memory.value is None else PredictedMemory.read(memory),
                   exposed_comm_s=_per_axis(f.key("exposed_comm_s", None)),
                   overlapped_comm_s=_per_axis(f.key("overlapped_comm_s", None)))


# The figures every plan carries, in the order summary() and diff show them (by their names on
# disk).
PREDICTED = ("step_time_s", "compute_s", "comm_s", "ilp_memory_bytes")
_KEYS = ("step_time_s", "compute_s", "host_s", "comm_s", "ilp_memory_bytes", "optimizer_s",
         "peak_phase", "host_step_s", "memory", "exposed_comm_s", "overlapped_comm_s")


@dataclass(frozen=True)
class StagePrediction:
    """One pipeline stage's figures (docs/cost-model.md §10): ``compute_s`` and ``comm_s`` of
    one microbatch; ``ilp_sum_bytes``, the sum of its state and what forward saves with the
    schedule's microbatches in flight, which the cut search balances (on disk
    ``ilp_memory_bytes``); ``peak_bytes``, the liveness walk of its part of the step program
    with those microbatches in flight (§10.4; None in plans made before it was walked)."""

    compute_s: float
    comm_s: float
    ilp_sum_bytes: float
    peak_bytes: float | None = None

    def to_json(self) -> dict[str, float]:
        out = {"compute_s": self.compute_s, "comm_s": self.comm_s,
               "ilp_memory_bytes": self.ilp_sum_bytes}
        if self.peak_bytes is not None:
            out["peak_bytes"] = self.peak_bytes
        return out

    @classmethod
    def from_json(cls, d: Any, where: str = "predicted") -> "StagePrediction":
        return cls.read(Field(d, where))

    @classmethod
    def read(cls, f: Field) -> "StagePrediction":
        obj = _renamed(f)
        _known_keys(f, ("compute_s", "comm_s", "ilp_memory_bytes", "peak_bytes"))
        peak = f.key("peak_bytes", None)
        return cls(f.key("compute_s").number(), f.key("comm_s").number(),
                   obj.key("ilp_memory_bytes").number(),
                   None if peak.value is None else peak.number())


def _renamed(f: Field) -> Field:
    """``f`` with each figure under an earlier name read under the new one (the file's object
    is left as it is)."""
    obj = dict(f.obj())
    for old, new in RENAMED.items():
        if old in obj:
            value = obj.pop(old)
            obj.setdefault(new, value)
    return Field(obj, f.where)


def _known_keys(f: Field, keys) -> None:
    """Refuse a figure no plan writes (a misspelt key would otherwise be dropped unseen)."""
    for k in f.obj():
        if k not in keys and k not in RENAMED:
            f.key(k).fail(f"not a figure of docs/plan-format.md (those are {', '.join(keys)})")


def _per_axis(f: Field) -> dict[str, float] | None:
    """A figure per mesh axis, as the file orders the axes."""
    if f.value is None:
        return None
    return {axis: x.number() for axis, x in ((k, f.key(k)) for k in f.obj())}
