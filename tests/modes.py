"""Models with dropout and batch norm, and what each rank runs to compare ``pm.eval()`` /
``pm.train()`` with one device and to read the dropout masks each shard draws. Used by
tests/test_training_loop.py; module level, so the world's ranks unpickle these by reference."""
from __future__ import annotations

from pathlib import Path

import torch

from autoshard import Mesh, Plan
from autoshard.solver.baselines import STORED, baseline_plan, stored_plan
from autoshard.trace.export import trace

P = 0.1
CLUSTER = str(Path(__file__).parent / "data" / "compute_bound.json")


def dropout_model(name: str, seed: int = 0) -> tuple[torch.nn.Module, tuple]:
    """HF GPT-2 (residual, embedding and attention dropout) or Llama (attention dropout) at the
    zoo's tiny sizes with dropout ``P``, and the zoo model's inputs."""
    from autoshard.tools.verify import build
    from autoshard.zoo import hf
    inputs = build(f"hf-{name}-tiny", None, None, 0)[1]
    torch.manual_seed(seed)

    def make(tf):
        if name == "gpt2":
            config = tf.GPT2Config(vocab_size=hf.TINY_VOCAB, n_positions=hf.TINY_SEQ,
                                   n_embd=hf.TINY_HIDDEN, n_layer=hf.TINY_LAYERS,
                                   n_head=hf.TINY_HEADS, resid_pdrop=P, embd_pdrop=P,
                                   attn_pdrop=P, bos_token_id=0, eos_token_id=0,
                                   use_cache=False, attn_implementation="sdpa")
            model = tf.GPT2LMHeadModel(config)
            model.loss_type = "ForCausalLM"
            return model
        config = tf.LlamaConfig(vocab_size=hf.TINY_VOCAB, hidden_size=hf.TINY_HIDDEN,
                                intermediate_size=hf.TINY_FFN, num_hidden_layers=hf.TINY_LAYERS,
                                num_attention_heads=hf.TINY_HEADS, num_key_value_heads=2,
                                max_position_embeddings=hf.TINY_SEQ, attention_dropout=P,
                                use_cache=False, attn_implementation="sdpa")
        return tf.LlamaForCausalLM(config)
    return hf._wrap(make, None).train(), inputs


class BNNet(torch.nn.Module):
    """Batch norm between two linears: buffers a checkpoint must carry (its running
    statistics), which eval mode uses."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.relu(self.bn(self.fc1(x))))
        return torch.nn.functional.mse_loss(out, y)


def bn_model(seed: int = 0) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(0)
    return BNNet(), (torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g))


class ConvBlock(torch.nn.Module):
    """A convolution, batch norm and ReLU with a residual: blocks alike are layers that
    checkpointing may recompute (trace/layers.py ``checkpointable``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class ConvNet(torch.nn.Module):
    """Two alike convolution blocks between a stem and a pooled linear head."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = torch.nn.ModuleList(ConvBlock(channels) for _ in range(2))
        self.head = torch.nn.Linear(channels, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.max_pool2d(self.stem(x), 2)
        for block in self.blocks:
            h = block(h)
        logits = self.head(torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))
        return torch.nn.functional.cross_entropy(logits, y)


def conv_model(seed: int = 0) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(0)
    return ConvNet(), (torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))


def drop_path_hf(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Hugging Face's drop path (e.g. transformers' ConvNext, Swin, BEiT): ``floor(q + U)``."""
    if p == 0.0 or not training:
        return x
    keep = 1 - p
    mask = keep + torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device)
    mask.floor_()
    return x.div(keep) * mask


def drop_path_timm(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """timm's drop path: ``bernoulli_(q)``, scaled by 1/q in place."""
    if p == 0.0 or not training:
        return x
    keep = 1 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    mask.div_(keep)
    return x * mask


class DropPathBlock(torch.nn.Module):
    """Two residual branches, each under one idiom of stochastic depth."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.norm, self.p = torch.nn.LayerNorm(width), p
        self.fc1, self.fc2 = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.fc3 = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + drop_path_hf(self.fc2(torch.relu(self.fc1(self.norm(x)))), self.p, self.training)
        return x + drop_path_timm(self.fc3(x), self.p, self.training)


class DropPathNet(torch.nn.Module):
    """Alike blocks with stochastic depth (probability rising with depth, as ViTs use it)."""

    def __init__(self, width: int = 16, p: float = 0.5) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(DropPathBlock(width, p * (i + 1) / 2) for i in range(2))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.mse_loss(self.head(x).squeeze(-1), y)


def drop_path_model(seed: int = 0) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(0)
    return DropPathNet(), (torch.randn(16, 4, 16, generator=g), torch.randn(16, 4, generator=g))


def make(kind: str, seed: int = 0) -> tuple[torch.nn.Module, tuple]:
    if kind == "droppath":
        return drop_path_model(seed)
    if kind in ("bn", "mlp"):
        return (bn_model if kind == "bn" else drop_mlp)(seed)
    if kind == "conv":
        return conv_model(seed)
    if kind == "resnet":            # Hugging Face's, batch norm after every convolution
        from autoshard.tools.verify import build
        return build("hf-resnet-tiny", None, None, seed)
    return dropout_model(kind, seed)


def plan_of(kind: str, shape: tuple[int, ...], baseline: str, **kw) -> Plan:
    model, inputs = make(kind)
    mesh = Mesh(shape, cluster=CLUSTER)
    traced = trace(model, inputs)
    if baseline in STORED:
        return stored_plan(traced, mesh, baseline, **kw)
    return baseline_plan(traced, mesh, baseline, **kw)


def channel_split_plan(kind: str, shape: tuple[int, ...], spec: tuple | None = None) -> Plan:
    """``kind``'s batch norms split on their channels in training: their weights pinned to
    ``spec`` (default: split over every axis), so each rank normalises its own channels and
    updates their running statistics, stored split (ops/batch_norm.py)."""
    from autoshard.ir import Shard, Strategy
    from autoshard.solver.planner import plan_traced
    model, inputs = make(kind)
    traced = trace(model, inputs)
    spec = spec or (Shard(0),) * len(shape)
    fixed = {p.name: Strategy((), (spec,)) for p in traced.params if ".bn." in p.fqn}
    return plan_traced(traced, Mesh(shape, cluster=CLUSTER), fixed=fixed)


def batch(inputs: tuple, step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    return tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) if t.is_floating_point()
                 else torch.randint(0, int(t.max()) + 1, t.shape, generator=g, dtype=t.dtype)
                 for t in inputs)


def _buffers(sd: dict) -> dict:
    return {k: v.clone() for k, v in sd.items() if "running" in k or "num_batches" in k}


def train_eval_train(kind: str, plan_json: str) -> dict:
    """A training step, two evaluations, a training step, under the plan and on one device
    (training steps under verify's keep-all masks, so dropout's draws agree): the losses, the
    buffers after each phase and the gradients at the end."""
    from autoshard.codegen.parallelize import parallelize
    from autoshard.loss import as_loss_module
    from autoshard.tools.draws import KeepAll
    from autoshard.tools.verify import rel_err
    plan = Plan.loads(plan_json)
    model, inputs = make(kind)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    ref = as_loss_module(make(kind)[0])
    out: dict = {"loss": [], "ref": []}

    def train_step(s):
        with KeepAll():
            out["loss"].append(float(pm.step(*pm.shard_inputs(*batch(inputs, s)))))
            loss = ref(*batch(inputs, s))
        loss.backward()
        out["ref"].append(float(loss))
    train_step(0)
    before = _buffers(pm.full_state_dict())
    pm.eval()
    ref.eval()
    out["modes"] = (pm.training, ref.training)
    with torch.no_grad():
        for s in (1, 2):
            out["loss"].append(float(pm(*pm.shard_inputs(*batch(inputs, s)))))
            out["ref"].append(float(ref(*batch(inputs, s))))
    after = _buffers(pm.full_state_dict())
    out["eval_kept_buffers"] = all(torch.equal(before[k], v) for k, v in after.items())
    out["has_buffers"] = bool(after)
    pm.train()
    ref.train()
    train_step(3)
    named = {n.removeprefix("model."): p for n, p in ref.named_parameters()}
    # (fc1's bias feeds a batch norm, which subtracts its mean: its exact gradient is zero and
    # what arrives is rounding noise, as verify.py's ERR_FLOOR note says)
    out["grad_err"] = max(rel_err(g, named[n].grad) for n, g in pm.full_grads().items()
                          if n != "fc1.bias")
    full = pm.full_state_dict()
    want = {n.removeprefix("model."): b for n, b in ref.named_buffers()}
    out["buffer_err"] = max((float((full[k].double() - want[k].double()).abs().max())
                             for k in _buffers(full)), default=0.0)
    return out


class DropMLP(torch.nn.Module):
    """Dropout between two linears and after the second (masks over the batch's rows), and on
    a gain vector (a parameter: not split by data parallelism)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.gain = torch.nn.Parameter(torch.ones(16))
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.drop(self.fc2(self.drop(torch.relu(self.fc1(x))))) * self.drop(self.gain)
        return torch.nn.functional.mse_loss(out, y)


def drop_mlp(seed: int = 0) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(0)
    return DropMLP(), (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g))


def masks_drawn(kind: str, plan_json: str) -> dict:
    """On this rank, seeded as every other: which of the program's mask-drawing ops the plan
    splits, the masks its dropouts draw in one training step (in order), the step's loss."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from autoshard.codegen.masks import ShardMasks, draws_masks
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = make(kind)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    masks = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.bernoulli_, torch.ops.aten.bernoulli):
                masks.append(out.detach().flatten().tolist())
            return out
    split = [isinstance(n.target, ShardMasks) for n in pm.program.graph.nodes
             if n.op == "call_function" and draws_masks(n)]
    torch.manual_seed(1234)                 # ranks seeded alike, as examples/train.py does
    with Record():
        loss = pm.step(*pm.shard_inputs(*inputs))
    return {"split": split, "masks": masks, "loss": float(loss)}


def grads_drawn(kind: str, plan_json: str) -> dict:
    """The full gradients of one training step with real dropout masks, ranks seeded alike,
    and how many of the program's ops draw a mask per shard."""
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = make(kind)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    torch.manual_seed(1234)
    pm.step(*pm.shard_inputs(*inputs))
    return pm.full_grads(), len(pm.seeded_masks)


def refusals(kind: str, plan_json: str) -> dict:
    """What pm.eval() and pm.parameters() say on this plan ("accepted" when they do not
    refuse)."""
    from autoshard.codegen.parallelize import parallelize
    from autoshard.errors import AutoshardError
    plan = Plan.loads(plan_json)
    model, inputs = make(kind)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    out = {}
    for name, fn in (("eval", pm.eval), ("parameters", lambda: list(pm.parameters()))):
        try:
            fn()
            out[name] = "accepted"
        except AutoshardError as e:
            out[name] = str(e)
    return out
