"""The plan's model again: traced from the name and input shapes the plan records (its
fingerprint must match), on the mesh it was priced on, and the model source line of each node."""
from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions
from autoshard.plans import Plan
from autoshard.trace.export import TracedGraph


@dataclass(frozen=True)
class Rebuilt:
    """The plan's model traced again as it was planned (precision, one microbatch on a
    pipeline), its fingerprint equal to the plan's, and the plan's mesh and options."""

    traced: TracedGraph
    mesh: Mesh
    options: PlanOptions
    seconds: float


def rebuild(plan: Plan, *, model: str | None = None, cluster: str | None = None,
            task: str | None = None) -> Rebuilt:
    """Trace the plan's model again: ``model`` (default the plan's ``model`` field: a zoo name,
    ``path/to/file.py:factory`` or a Hugging Face config) at the batch and sequence length of the
    plan's inputs; ``cluster``: the profile a plan made with one was priced on."""
    from autoshard.solver.planner import trace_for
    from autoshard.zoo.registry import load_model

    t0 = time.perf_counter()
    mesh = plan_mesh(plan, cluster)
    name = model or plan.model
    if not name:
        raise AutoshardError("a plan that names its model (its `model` field) to trace it again",
                             got="a plan without a model name (made in Python without "
                                 "model_name)",
                             fix="pass --model with the zoo name, path/to/file.py:factory or "
                                 "config.json the plan was made from")
    batch, seq = _sizes(plan, name)
    options = _settled(plan)
    try:
        built, inputs = load_model(name, batch=batch, seq=seq, device="meta", task=task)
        traced = trace_for(built, inputs, options)
    except AutoshardError as e:
        raise AutoshardError(f"the plan's model {name!r} rebuilt and traced again: {e.expected}",
                             got=e.got, fix=f"{e.fix}; or pass --model (and --task) as the "
                                            f"plan was made") from e
    sizes = "".join(f", {k} {v}" for k, v in (("batch", batch), ("seq", seq)) if v)
    try:
        plan.check_matches(traced.fingerprint, traced.node_sigs, what=f"model ({name}{sizes})")
    except AutoshardError as e:
        raise AutoshardError(e.expected, got=e.got,
                             fix="pass --model (and --task) naming the model the plan was made "
                                 "from, or re-plan it") from e
    return Rebuilt(traced, mesh, options, time.perf_counter() - t0)


def plan_mesh(plan: Plan, cluster: str | None = None) -> Mesh:
    """The plan's mesh on the cluster figures it records (``cluster``: the profile JSON of a
    file written before plans recorded them, Plan.priced_on)."""
    return plan.mesh(cluster)


def _sizes(plan: Plan, name: str) -> tuple[int | None, int | None]:
    """(batch, seq) of the plan's model inputs, as load_model takes them (None, None for a
    factory, which builds its own inputs)."""
    from autoshard.zoo import hf
    from autoshard.zoo.registry import ZOO

    if ":" in name and name.split(":", 1)[0].endswith(".py"):
        return None, None
    meta = plan.input_meta.get("input0")
    if meta is None:
        raise AutoshardError("a plan that records its inputs' shapes, to trace the model again",
                             got="no shape for input0",
                             fix="re-plan with this version of autoshard")
    shape = meta[0]
    batch = shape[0] * (plan.pipeline.microbatches if plan.pipeline else 1)
    if name in ZOO:
        return batch, (shape[1] if ZOO[name].seq is not None and len(shape) > 1 else None)
    if hf.is_config_path(name):          # token ids (batch, seq); images have no seq
        return batch, (shape[1] if len(shape) == 2 else None)
    return batch, None


def _settled(plan: Plan) -> PlanOptions:
    """The plan's options with its pipeline as found ("auto" settled to the plan's axis, or to
    none), so that the graph is traced as the plan's was: one microbatch on a pipeline."""
    return plan.settled_options()


def check_resolvable(plan: Plan) -> None:
    if plan.pipeline is not None:
        raise AutoshardError("a plan without a pipeline to re-solve with a node pinned",
                             got=f"a plan pipelined over {plan.pipeline.axis!r} (its stages' "
                                 f"cuts are a search of their own)",
                             fix="use --top on this plan, or explain a plan made without "
                                 "--pipeline")
    if len(plan.mesh_shape) > 2:
        raise AutoshardError("a plan on a 1-D or 2-D mesh to re-solve with a node pinned",
                             got=f"mesh {'x'.join(map(str, plan.mesh_shape))} (a 3-axis plan is "
                                 f"the best of several 2-axis merges)",
                             fix="use --top on this plan, or explain a plan of the same model "
                                 "on a 2-axis mesh")


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


@dataclass(frozen=True)
class Source:
    """Where the model's code made a node: the innermost frame of its stack outside torch and
    autoshard's loss wrapper (``nn.Linear.forward`` is torch's; the line calling it is the
    model's)."""

    file: str
    line: int
    function: str
    code: str
    # The model's line that called this one (``self.c_attn(x)`` for the addmm inside
    # transformers' Conv1D), None at the top of the model.
    caller: "Source | None" = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}: {self.code}"

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function,
                "code": self.code, "caller": self.caller.to_json() if self.caller else None}


def node_source(node: Any) -> Source | None:
    """The model source line of FX node ``node`` (None: a graph input, or no stack kept)."""
    if node is None:
        return None
    frames = []
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i, text in enumerate(lines):
        m = _FRAME.search(text)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.search(
                lines[i + 1]) else ""
            frames.append((m.group("file"), int(m.group("line")), m.group("func"), code))
    if not frames:
        return None
    own = [f for f in frames if not _library_frame(f[0])] or frames
    caller = None
    if len(own) > 1:
        file, line, func, code = own[-2]
        caller = Source(_short_path(file), line, func, code)
    file, line, func, code = own[-1]
    return Source(_short_path(file), line, func, code, caller)


def _library_frame(file: str) -> bool:
    """A frame of torch's own code, or of the loss wrapper autoshard puts around the model."""
    import torch
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    return os.path.abspath(file).startswith(torch_dir) or file.endswith(
        os.path.join("autoshard", "loss.py"))


def _short_path(file: str) -> str:
    """``file`` relative to the import root (or working directory) holding it: the module path
    a reader finds it under, the same on every machine."""
    path = os.path.abspath(file)
    roots = [os.path.abspath(p) for p in (*sys.path, os.getcwd()) if p]
    inside = [r for r in roots if path.startswith(r.rstrip(os.sep) + os.sep)]
    return os.path.relpath(path, max(inside, key=len)) if inside else path

