"""PlanOptions: every knob of planning in one frozen, validated value.

``autoshard.plan(model, inputs, mesh, options=None, **overrides)`` and ``autoshard.parallelize``
take it; the CLI maps its flags onto it; the Plan JSON records it (``"options"``) and
``Plan.load`` restores it. A planning technique adds its field here, with a default that keeps
plans as they were.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir import OffloadLevel, OffloadOverlap, StateMode
from autoshard.schedules import SCHEDULES as PIPELINE_SCHEDULES

OPTIMIZERS = ("adam", "adamw", "sgd", "none")
# "model": parameters, activations and gradients in the model's own dtypes; a 16-bit model is
# priced as mixed-precision training (fp32 master weights and Adam states, docs/cost-model.md §4).
# "bf16-mixed": the step runs in bf16 whatever the model's dtype, with fp32 masters and Adam
# states (autoshard/precision.py).
PRECISIONS = ("model", "bf16-mixed")
# Activation checkpointing of the model's repeated layers (docs/cost-model.md §8): "none",
# "selective" (every such layer keeps the outputs of its matmuls, attention and collectives and
# recomputes the rest in backward), "full" (every such layer keeps its inputs only and
# recomputes its forward), or "auto" (the planner decides: selective or full only where it
# makes a plan fit or run faster).
RECOMPUTE = ("auto", "none", "selective", "full")
# Where gradients and optimizer state live apart from the parameter (docs/cost-model.md §9):
# "auto" (the planner chooses per parameter between plain and ZeRO-2), "none" (they follow the
# parameter), or one of "zero1"/"zero2" on every parameter that has a replicated axis.
ZERO = ("auto", "none", "zero1", "zero2")
# Offload to the host (docs/cost-model.md §9): "optimizer" puts every parameter's optimizer state
# and step on the host (ZeRO-Offload); "parameters" the stored parameters and their gradients too,
# each parameter copied to the device at each use (ZeRO-Infinity, FSDP2's CPUOffloadPolicy);
# "auto": optimizer offload only where no plan fits without it, parameter offload only where no
# plan fits with optimizer offload alone (each costs host-link time); "none".
OFFLOAD = tuple(OffloadLevel)
# How the host's optimizer step under optimizer offload overlaps the device (codegen/hostopt.py,
# docs/cost-model.md §9.1): "backward" (each bucket of parameters steps on the host as soon as
# its gradients are complete, while backward goes on; the numbers of "none"), "delayed"
# (ZeRO-Offload's delayed parameter update: the host step of step t runs during step t+1's
# forward and backward, whose parameters are one update behind), or "none" (after backward).
OFFLOAD_OVERLAP = tuple(OffloadOverlap)
# Context parallelism, the attention's query sequence split in the zigzag layout
# (docs/cost-model.md §3.11): "on" offers it wherever attention allows it, "off" never, "auto"
# where the longest attention reads at least CONTEXT_PARALLEL_TOKENS keys; "gather" and "ring"
# as "on" with only that variant of attention (K/V all-gathered, or passed around a ring). Below that the
# sequence's variants grow the ILP (by 75% on Llama-3-8B at 2048 tokens) for a choice that
# does not pay: attention's share of a layer's work grows with s/h, and at 2048-8192 tokens the
# heads and the batch split it well (Llama 3 trained with context parallelism only in its
# long-context stage, arXiv 2407.21783 §3.3).
CONTEXT_PARALLEL = ("auto", "on", "off", "gather", "ring")
CONTEXT_PARALLEL_TOKENS = 16384
# Pipeline schedules, as torch.distributed.pipelining names its classes (docs/cost-model.md §10):
# "GPipe" (every microbatch forward, then every backward), "1F1B" (one forward, one backward in
# steady state: the same bubble, at most p - i microbatches of activations alive on stage i),
# "Interleaved1F1B" (two stages per rank: the bubble halved for twice the sends),
# "InterleavedZeroBubble" (two stages per rank, backward split into the inputs' gradient and the
# weights', which fills the bubble; activations kept longer), "ZBVZeroBubble" (the same split,
# a rank's two stages placed as a V: r and 2p - 1 - r, one send fewer, activations even across
# the ranks; any number of microbatches), "DualPipeV" (DeepSeek-V3's DualPipe, V-shaped: placed
# as ZBVZeroBubble, a forward paired with another microbatch's backward; at least 2p
# microbatches), or "auto" (the planner picks the one it prices fastest, less memory breaking
# ties).
SCHEDULES = (*PIPELINE_SCHEDULES, "auto")


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """How to plan. Every field has a default; construct with keywords only.

    - ``training``: plan forward + backward + optimizer (True) or forward only.
    - ``optimizer``: what optimizer state each parameter carries: "adam"/"adamw" (two moments),
      "sgd" (none), "none" (parameters only; implied for inference).
    - ``precision``: the dtypes the step runs in (see PRECISIONS).
    - ``memory_budget``: bytes per device a plan may use; None = the cluster's device memory.
    - ``time_limit_s``: the ILP solver's time limit per solve, seconds.
    - ``bucket_mb``: gradient all-reduces of data-parallel parameters are fused into buckets of
      up to this many MiB (DDP's ``bucket_cap_mb``, default 25), issued as soon as their
      gradients are ready and overlapped with the rest of backward (docs/cost-model.md §7).
    - ``recompute``: activation checkpointing of repeated layers (see RECOMPUTE).
    - ``zero``: gradient and optimizer-state sharding apart from the parameter (see ZERO).
    - ``offload``: optimizer state and step, or the parameters too, on the host (see OFFLOAD).
    - ``offload_overlap``: how the host's optimizer step overlaps the device (see
      OFFLOAD_OVERLAP); "delayed" changes the numbers (one update behind).
    - ``context_parallel``: whether attention may split its query sequence (see
      CONTEXT_PARALLEL).
    - ``pipeline``: the mesh axis whose devices hold consecutive pipeline stages (cuts at the
      model's layer boundaries), None for no pipeline, or "auto" (``autoshard.plan`` plans
      without and over each axis, and keeps the fastest) (docs/cost-model.md §10).
    - ``schedule``: the pipeline schedule (see SCHEDULES).
    - ``microbatches``: how many microbatches the batch is cut into on a pipeline, or "auto"
      (the planner tries p, 2p and 4p for p stages, where they divide the batch).
    - ``stage_run``: set by the pipeline planner on the options of the SPMD plan its stages
      share (solver/pipeline.py), None otherwise: ``(m, k)``, the graph is one of ``m``
      microbatches (it bears 1/m of the once-per-step gradient sync and optimizer step) and
      ``k`` microbatches' activations are alive at once on the fullest stage (cost/price.py).
    - ``accumulation_steps``: micro-steps per optimizer step (gradient accumulation: each
      micro-step runs forward and backward on one batch as planned, under ``pm.no_sync()`` but
      the last; then one gradient sync and one optimizer step). The plan's step figures are
      the optimizer step's: forward and backward N times, the gradient sync and the optimizer
      step once, the gradients held across micro-steps (docs/cost-model.md §7.2). 1: none.
      A pipeline accumulates over its microbatches instead (``microbatches``).
    - ``compile``: the rank program runs compiled by inductor (codegen/compile.py) and is priced
      so: fused kernels, no host dispatch per op; False: eager, each op paying the host's
      dispatch where it exceeds the device's time (docs/cost-model.md §3.10). Off by default:
      the compiled program is proven on CPU (gloo), not yet on CUDA.
    """

    training: bool = True
    optimizer: str = "adam"
    precision: str = "model"
    memory_budget: float | None = None
    time_limit_s: float = 20.0
    bucket_mb: float = 25.0
    recompute: str = "auto"
    zero: str = "auto"
    offload: OffloadLevel = OffloadLevel.AUTO
    offload_overlap: OffloadOverlap = OffloadOverlap.NONE
    context_parallel: str = "auto"
    pipeline: str | None = None
    schedule: str = "auto"
    microbatches: int | str = "auto"
    stage_run: tuple[int, float] | None = None
    compile: bool = False
    accumulation_steps: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.training, bool):
            raise AutoshardError("PlanOptions.training is True or False", got=repr(self.training),
                                 fix="pass training=False to plan forward only")
        if self.optimizer not in OPTIMIZERS:
            raise AutoshardError(f"PlanOptions.optimizer is one of {OPTIMIZERS}",
                                 got=repr(self.optimizer),
                                 fix="pass optimizer='adam' (Adam/AdamW), 'sgd' or 'none'")
        if self.precision not in PRECISIONS:
            raise AutoshardError(f"PlanOptions.precision is one of {PRECISIONS}",
                                 got=repr(self.precision),
                                 fix="pass precision='model' (the model's own dtypes) or "
                                     "'bf16-mixed'")
        if self.memory_budget is not None and not _positive(self.memory_budget):
            raise AutoshardError("PlanOptions.memory_budget is a positive number of bytes or None",
                                 got=repr(self.memory_budget),
                                 fix="e.g. memory_budget=70 * 2**30, or None for the device's")
        if not _positive(self.time_limit_s):
            raise AutoshardError("PlanOptions.time_limit_s is a positive number of seconds",
                                 got=repr(self.time_limit_s), fix="e.g. time_limit_s=20")
        if not _positive(self.bucket_mb):
            raise AutoshardError("PlanOptions.bucket_mb is a positive number of MiB",
                                 got=repr(self.bucket_mb),
                                 fix="e.g. bucket_mb=25 (DDP's default bucket size)")

        if self.recompute not in RECOMPUTE:
            raise AutoshardError(f"PlanOptions.recompute is one of {RECOMPUTE}",
                                 got=repr(self.recompute),
                                 fix="pass recompute='auto' (the planner decides), 'none', "
                                     "'selective' or 'full'")

        if self.zero not in ZERO:
            raise AutoshardError(f"PlanOptions.zero is one of {ZERO}", got=repr(self.zero),
                                 fix="pass zero='auto' (the planner decides), 'none', 'zero1' "
                                     "or 'zero2'")
        if self.offload_overlap not in OFFLOAD_OVERLAP:
            raise AutoshardError(f"PlanOptions.offload_overlap is one of {OFFLOAD_OVERLAP}",
                                 got=repr(self.offload_overlap),
                                 fix="pass offload_overlap='none' (the default: the host steps after "
                                     "backward), 'backward' or 'delayed' (one update behind)")
        if self.context_parallel not in CONTEXT_PARALLEL:
            raise AutoshardError(f"PlanOptions.context_parallel is one of {CONTEXT_PARALLEL}",
                                 got=repr(self.context_parallel),
                                 fix="pass context_parallel='auto' (offered from "
                                     f"{CONTEXT_PARALLEL_TOKENS} tokens), 'on', 'off', or "
                                     "'gather' / 'ring' for one variant of attention")
        if self.offload not in OFFLOAD:
            raise AutoshardError(f"PlanOptions.offload is one of {OFFLOAD}",
                                 got=repr(self.offload),
                                 fix="pass offload='auto' (only where nothing fits without it), "
                                     "'none', 'optimizer' or 'parameters'")
        # Held as the enums' members (a str given compares equal): one type wherever read.
        object.__setattr__(self, "offload", OffloadLevel(self.offload))
        object.__setattr__(self, "offload_overlap", OffloadOverlap(self.offload_overlap))

        if self.pipeline is not None and (not isinstance(self.pipeline, str) or not self.pipeline):
            raise AutoshardError("PlanOptions.pipeline is a mesh axis name, 'auto' or None",
                                 got=repr(self.pipeline),
                                 fix="pass pipeline='pp' (an axis of the mesh), 'auto' or None")
        if self.schedule not in SCHEDULES:
            raise AutoshardError(f"PlanOptions.schedule is one of {SCHEDULES}",
                                 got=repr(self.schedule),
                                 fix=f"pass one of {', '.join(map(repr, SCHEDULES))}")
        m = self.microbatches
        if m != "auto" and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise AutoshardError("PlanOptions.microbatches is a positive integer or 'auto'",
                                 got=repr(m), fix="e.g. microbatches=8, or 'auto'")
        if not isinstance(self.compile, bool):
            raise AutoshardError("PlanOptions.compile is True or False", got=repr(self.compile),
                                 fix="pass compile=True to run (and price) the rank program "
                                     "compiled by inductor")
        self._check_accumulation()
        r = self.stage_run
        if r is not None and not (isinstance(r, (tuple, list)) and len(r) == 2
                                  and _positive(r[0]) and _positive(r[1])):
            raise AutoshardError("PlanOptions.stage_run is None or (microbatches, activation "
                                 "copies), set by the pipeline planner", got=repr(r),
                                 fix="leave it None")

    def _check_accumulation(self) -> None:
        n = self.accumulation_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise AutoshardError("PlanOptions.accumulation_steps is a positive integer (micro-steps "
                                 "per optimizer step)", got=repr(n),
                                 fix="e.g. accumulation_steps=4, or 1 for none")
        if n > 1 and not self.training:
            raise AutoshardError("gradient accumulation (accumulation_steps > 1) in a training "
                                 "plan", got=f"accumulation_steps={n} with training=False",
                                 fix="pass accumulation_steps=1 for a forward-only plan")
        if n > 1 and self.pipeline is not None:
            raise AutoshardError("accumulation_steps=1 on a pipeline (its schedule accumulates "
                                 "the microbatches of a step)",
                                 got=f"accumulation_steps={n}, pipeline={self.pipeline!r}",
                                 fix=f"pass microbatches={n} times the microbatches you had, "
                                     "or plan without a pipeline")

    @property
    def bucket_bytes(self) -> float:
        return self.bucket_mb * 2**20

    @property
    def state_optimizer(self) -> str:
        """The optimizer whose state parameters carry: none when only the forward runs."""
        return self.optimizer if self.training else "none"

    def replace(self, **overrides: Any) -> "PlanOptions":
        """A copy with ``overrides`` applied; an unknown name is an error naming the fields."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise AutoshardError(f"plan options among {sorted(known)}", got=str(unknown),
                                 fix="check the spelling, or pass options=PlanOptions(...)")
        return dataclasses.replace(self, **overrides) if overrides else self

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["stage_run"] is None:      # the pipeline planner's own: not in plan files
            del out["stage_run"]
        if out["offload_overlap"] == OffloadOverlap.NONE:  # the default: files stay as they were
            del out["offload_overlap"]
        if out["context_parallel"] == "auto":  # the same
            del out["context_parallel"]
        if not out["compile"]:            # eager: plan files as before the option existed
            del out["compile"]
        if out["accumulation_steps"] == 1:     # the same
            del out["accumulation_steps"]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PlanOptions":
        return cls().replace(**data)


def state_modes(options: PlanOptions, offload: OffloadLevel) -> tuple[StateMode | None, ...]:
    """The state modes (cost/state.py) parameters may take under ``options``; ``offload``: how
    far the planner is trying offload under ``options.offload`` "auto": "none" (not at all),
    "optimizer" (mode "offload"), or "parameters" (the parameters' too: "offload_params" beside
    "offload"). A forced ``options.offload`` is the one mode offered.
    A pipeline's stages (``stage_run``) are not offered parameter offload."""
    if options.offload == OffloadLevel.OPTIMIZER:
        return (StateMode.OFFLOAD,)
    if options.offload == OffloadLevel.PARAMETERS:
        return (StateMode.OFFLOAD_PARAMS,)
    # "auto" offers ZeRO-2, not ZeRO-1: priced alike, ZeRO-1 never beats it (the same gather
    # after the step, an all-reduce where ZeRO-2 reduce-scatters, more memory), and every mode
    # offered grows the ILP.
    zero = {"auto": (None, StateMode.ZERO2), "none": (None,), "zero1": (StateMode.ZERO1,),
            "zero2": (StateMode.ZERO2,)}[options.zero]
    if offload == OffloadLevel.NONE or options.offload != OffloadLevel.AUTO:
        return zero
    params = offload == OffloadLevel.PARAMETERS and options.stage_run is None
    return zero + (StateMode.OFFLOAD,) + ((StateMode.OFFLOAD_PARAMS,) if params else ())


def _positive(v: Any) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        v = float(v)
    except OverflowError:        # an int beyond any float (10**400) is no budget either
        return False
    return math.isfinite(v) and v > 0


def resolve_options(options: PlanOptions | None, overrides: dict[str, Any]) -> PlanOptions:
    """``options`` (default: all defaults) with keyword ``overrides`` applied."""
    if options is not None and not isinstance(options, PlanOptions):
        raise AutoshardError("options is an autoshard.PlanOptions", got=type(options).__name__,
                             fix="pass options=autoshard.PlanOptions(...) or keywords")
    return (options or PlanOptions()).replace(**overrides)
