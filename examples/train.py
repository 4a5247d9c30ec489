"""Train a small GPT with an autoshard plan, under torchrun.

    torchrun --nproc-per-node 4 examples/train.py --mesh 2x2 --steps 50               # CPU, gloo
    torchrun --nproc-per-node 4 examples/train.py --mesh 2x2 --steps 50 --device cuda # GPUs, nccl

Every rank builds the same model (same seed). Rank 0 plans (``autoshard.plan``) and broadcasts
the plan as JSON, or every rank loads ``--plan plan.json``; then each rank runs its shard of the
program (``autoshard.parallelize``) and AdamW through ``pm.optimizer``, which keeps the
optimizer state where the plan puts it (with each parameter shard, or sharded apart from it:
ZeRO-1/2, or on the host). The data is a synthetic language with a learnable rule (each next token is a fixed
permutation of the current one), so the loss falls from ln(vocab) towards zero in a few dozen
steps. Every rank draws the same global batch; ``pm.shard_inputs`` keeps this rank's share.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

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
    ap.add_argument("--lr", type=float, default=3e-3)
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
        if rank == 0:
            n_full = sum(p.numel() for p in model.parameters())
            n_local = sum(p.numel() for p in pm.parameters())
            print(plan.summary())
            print(f"planned and built in {time.perf_counter() - t0:.1f} s; {n_full} parameters, "
                  f"{n_local} on rank 0", flush=True)
            if args.save_plan:
                plan.save(args.save_plan)
        del model   # the full model is no longer needed: pm holds this rank's shards

        opt = pm.optimizer(torch.optim.AdamW, lr=args.lr)
        t0, last = time.perf_counter(), 0
        for step in range(1, args.steps + 1):
            x, y = synthetic_batch(step, batch=args.batch, seq=args.seq, vocab=args.vocab,
                                   perm=perm, device=device)
            loss = pm.step(*pm.shard_inputs(x, y))
            opt.step()
            opt.zero_grad()
            pm.ledger.clear()   # it records every collective run; uncleared, it grows every step
            if rank == 0 and (step % args.log_every == 0 or step == 1 or step == args.steps):
                now = time.perf_counter()
                ms = (now - t0) / (step - last) * 1e3     # since the last line printed
                t0, last = now, step
                print(f"step {step:4d}  loss {loss.item():.4f}  ({ms:.1f} ms/step)", flush=True)

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
