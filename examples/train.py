"""Train a small GPT with an autoshard plan, under torchrun: the loop to copy.

    torchrun --nproc-per-node 4 examples/train.py --mesh 2x2 --steps 100 --ckpt-dir ckpt   # CPU, gloo
    torchrun --nproc-per-node 4 examples/train.py --mesh 2x2 --steps 100 --ckpt-dir ckpt --resume
    torchrun --nproc-per-node 8 examples/train.py --mesh 2x4 --device cuda --steps 100     # GPUs, nccl

Every rank builds the same model (same seed). Rank 0 plans (``autoshard.plan``) and broadcasts
the plan as JSON, or every rank loads ``--plan plan.json``; then each rank runs its shard of the
program (``autoshard.parallelize``). The loop is the one torchtitan and nanoGPT write, unchanged:
AdamW through ``pm.optimizer`` (a ``torch.optim.Optimizer`` keeping the state where the plan puts
it: with each parameter shard, sharded apart (ZeRO-1/2) or on the host) with nanoGPT's parameter
groups (no weight decay on biases and norms), a LambdaLR warmup +
cosine schedule, gradient accumulation over ``--accum`` micro-batches (the bucketed gradient
sync deferred to the last by ``pm.no_sync()``), torch's own ``clip_grad_norm_`` over
``pm.parameters()`` (DTensors: the norm is the whole model's), evaluation every
``--eval-every`` steps, and DCP checkpoints of the whole training state (model, optimizer,
scheduler, step, RNG) every ``--ckpt-every`` steps, from which ``--resume`` goes on, under this
plan or any other. Each log line gives the loss, tokens/s and the MFU beside the plan's
predicted step time. The data is a synthetic language with a learnable rule (each next token is
a fixed permutation of the current one), generated here (no downloads): the loss falls from
ln(vocab) towards zero. Every rank draws the same global batch of a step;
``pm.shard_inputs`` keeps this rank's share.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autoshard
from autoshard.zoo.models import GPT, GPTConfig


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="2x2",
                    help="mesh shape, e.g. 4 or 2x2 (its product is the world size)")
    ap.add_argument("--axes", default=None, help="axis names, e.g. dp,tp (default dp,tp for 2-D)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cluster", default=None,
                    help="cost model to plan with: h100 | h200 | a100 | cpu | profile.json "
                         "(default: cpu for --device cpu, h100 for --device cuda)")
    ap.add_argument("--plan", default=None, help="run this plan file instead of planning")
    ap.add_argument("--pipeline", default=None,
                    help="pipeline the layers over this mesh axis (or auto), e.g. --axes pp,tp "
                         "--pipeline pp")
    ap.add_argument("--save-plan", default=None, help="rank 0 writes the plan it ran here")
    ap.add_argument("--save", default=None, help="rank 0 saves the full state dict here at the end")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch size")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=10, help="linear warmup steps, then cosine")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--ckpt-dir", default=None, help="DCP checkpoints go here (step<N>/)")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true",
                    help="go on from the latest checkpoint in --ckpt-dir")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def synthetic_batch(step: int, *, batch: int, seq: int, vocab: int, perm: torch.Tensor,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that follow ``x[t+1] = perm[x[t]]`` from random starts; the labels are the
    next tokens (the zoo GPT's loss does not shift labels). Identical on every rank."""
    g = torch.Generator().manual_seed(10_000 + step)
    tok = torch.randint(0, vocab, (batch,), generator=g)
    cols = [tok]
    for _ in range(seq):
        tok = perm[tok]
        cols.append(tok)
    ids = torch.stack(cols, dim=1)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def warmup_cosine(warmup: int, total: int):
    """The LambdaLR factor: linear warmup to the peak, then cosine decay to zero."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return factor


def param_groups(named_parameters, weight_decay: float) -> list[dict]:
    """nanoGPT's and GPT-2's AdamW groups: weight decay on the matrices (embeddings, linear
    weights), none on the biases and norms. Given ``pm.named_parameters()``, whose DTensors have
    the global shapes, the groups are the single-device model's."""
    decay, rest = [], []
    for _, p in named_parameters:
        if p.requires_grad:
            (decay if p.dim() >= 2 else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def training_state(pm, opt, sched, step: int) -> dict:
    """The whole training state for torch.distributed.checkpoint: the model's and the
    optimizer's shards as DTensors (DCP reshards them onto any plan), the scheduler, the step
    (the synthetic data is a function of it: the data position) and the RNG."""
    return {"model": pm.sharded_state_dict(), "optim": opt.sharded_state_dict(),
            "sched": sched.state_dict(), "step": step, "rng": torch.get_rng_state()}


def latest_checkpoint(ckpt_dir: str | None) -> Path | None:
    steps = sorted(Path(ckpt_dir).glob("step*"), key=lambda p: int(p.name[4:])) \
        if ckpt_dir and Path(ckpt_dir).is_dir() else []
    return steps[-1] if steps else None


def evaluate(pm, args, perm, device, batches: int = 2) -> float:
    """The mean loss over held-out batches (seeds no training step draws), forward only."""
    total = 0.0
    pm.eval()             # as model.eval(): dropout off, batch norm on its running statistics
    try:
        with torch.no_grad():
            for i in range(batches):
                x, y = synthetic_batch(-1 - i, batch=args.batch, seq=args.seq, vocab=args.vocab,
                                       perm=perm, device=device)
                total += float(pm(*pm.shard_inputs(x, y)))
    finally:
        pm.train()
    return total / batches


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    try:
        shape = tuple(int(n) for n in args.mesh.lower().split("x"))
        axes = tuple(a.strip() for a in args.axes.split(",")) if args.axes else None
        cluster = args.cluster or ("h100" if args.device == "cuda" else "cpu")
        mesh = autoshard.Mesh(shape, axes, cluster=cluster)

        torch.manual_seed(args.seed)
        cfg = GPTConfig(args.layers, args.hidden, args.heads, vocab_size=args.vocab,
                        context=args.seq)
        with device:
            model = GPT(cfg)
        perm = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(args.seed + 1))
        example = synthetic_batch(0, batch=args.batch, seq=args.seq, vocab=args.vocab, perm=perm,
                                  device=device)

        # Planning is deterministic, but one rank is enough: rank 0 plans, the others get JSON.
        t0 = time.perf_counter()
        if args.plan:
            plan = autoshard.Plan.load(args.plan)
        else:
            box = [autoshard.plan(model, example, mesh, model_name="gpt-example",
                                  pipeline=args.pipeline).dumps()
                   if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            plan = autoshard.Plan.loads(box[0])
        pm = autoshard.parallelize(model, mesh, plan=plan, example_inputs=example)
        n_params = sum(p.numel() for p in model.parameters())
        if rank == 0:
            n_local = sum(p.numel() for p in pm.local_parameters().values())
            print(plan.summary())
            print(f"planned and built in {time.perf_counter() - t0:.1f} s; {n_params} parameters, "
                  f"{n_local} on rank 0", flush=True)
            if args.save_plan:
                plan.save(args.save_plan)
        del model   # the full model is no longer needed: pm holds this rank's shards

        opt = pm.optimizer(torch.optim.AdamW, param_groups(pm.named_parameters(), 0.1),
                           lr=args.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
        start = 0
        found = latest_checkpoint(args.ckpt_dir) if args.resume else None
        if found is not None:
            state = training_state(pm, opt, sched, 0)
            dcp.load(state, checkpoint_id=str(found))
            pm.load_sharded_state_dict(state["model"])
            opt.load_sharded_state_dict(state["optim"])
            sched.load_state_dict(state["sched"])
            torch.set_rng_state(state["rng"])
            start = state["step"]
            if rank == 0:
                print(f"resumed from {found} at step {start}", flush=True)

        # Training FLOPs 6 * parameters * tokens (Kaplan et al. 2020), over the mesh's peak.
        tokens = args.batch * args.seq * args.accum
        peak = mesh.cluster.fp32_flops * mesh.size         # the model is fp32
        predicted_s = plan.predicted.step_time_s * args.accum   # the plan is one micro-batch
        t0, last = time.perf_counter(), start
        for step in range(start + 1, args.steps + 1):
            loss = 0.0
            for micro in range(args.accum):
                x, y = synthetic_batch(step * args.accum + micro, batch=args.batch, seq=args.seq,
                                       vocab=args.vocab, perm=perm, device=device)
                if micro + 1 < args.accum and pm.pipeline is None:
                    with pm.no_sync():          # the bucketed sync waits for the last one
                        loss += float(pm.step(*pm.shard_inputs(x, y)))
                else:
                    loss += float(pm.step(*pm.shard_inputs(x, y)))
            norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), args.clip)
            opt.step()
            sched.step()
            opt.zero_grad()
            pm.ledger.clear()   # it records every collective run; uncleared, it grows every step
            if rank == 0 and (step % args.log_every == 0 or step == start + 1
                              or step == args.steps):
                now = time.perf_counter()
                s = (now - t0) / (step - last)           # since the last line printed
                t0, last = now, step
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                print(f"step {step:4d}  loss {loss / args.accum:.4f}  norm {float(norm):.3f}  "
                      f"lr {sched.get_last_lr()[0]:.2e}  {tokens / s:,.0f} tok/s  "
                      f"MFU {6 * n_params * tokens / s / peak:.2%}  "
                      f"({s * 1e3:.0f} ms/step; plan predicts {predicted_s * 1e3:.0f})",
                      flush=True)
            if args.eval_every and step % args.eval_every == 0:
                val = evaluate(pm, args, perm, device)
                if rank == 0:
                    print(f"step {step:4d}  eval loss {val:.4f}", flush=True)
            if args.ckpt_dir and (step % args.ckpt_every == 0 or step == args.steps):
                dcp.save(training_state(pm, opt, sched, step),
                         checkpoint_id=str(Path(args.ckpt_dir) / f"step{step}"))
                if rank == 0:
                    print(f"step {step:4d}  checkpoint {args.ckpt_dir}/step{step}", flush=True)

        if args.save:
            state = pm.full_state_dict()       # a collective: every rank takes part
            if rank == 0:
                torch.save({k: v.cpu() for k, v in state.items()}, args.save)
                print(f"saved {len(state)} tensors to {args.save}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
