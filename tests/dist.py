"""The tests' multi-process harness lives in the package (``autoshard verify`` uses it too);
what several test files run on each rank lives here."""
from autoshard.codegen.world import RankCrash, RankError, World, world_fixture

__all__ = ["RankCrash", "RankError", "World", "world_fixture", "adamw_steps"]


def adamw_steps(model_name: str, plan_json: str, steps: int):
    """On one rank: ``steps`` AdamW steps through pm.optimizer against single-device AdamW.
    Returns the largest relative parameter difference at the end, and the full state dict.
    On the way: what the plan keeps on the host (parameter offload) stays there, and the full
    state dict loads back unchanged."""
    import torch

    from autoshard import Mesh, Plan
    from autoshard.codegen.parallelize import parallelize
    from autoshard.loss import as_loss_module
    from autoshard.tools.verify import build, rel_err
    plan = Plan.loads(plan_json)
    model, inputs = build(model_name, None, None, 0)
    ref = as_loss_module(build(model_name, None, None, 0)[0])
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan, example_inputs=inputs)
    streamed = {f for f, st in plan.param_state.items() if st.mode == "offload_params"}
    assert pm.on_host == streamed
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    assert all(e.master.device.type == "cpu" for e in opt.entries if e.fqn in streamed)
    # (their step is the bucketed fused one of codegen/hostopt.py, as optimizer offload's)
    assert all(opt.host is not None and opt.host.owns(e) for e in opt.entries
               if e.fqn in streamed)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    local = pm.shard_inputs(*inputs)
    for _ in range(steps):
        pm.step(*local)
        opt.step()
        opt.zero_grad()
        ref(*inputs).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = pm.full_state_dict()
    pm.load_full_state_dict(full)
    again = pm.full_state_dict()
    assert all(torch.equal(again[k], v) for k, v in full.items())
    # A key projection's bias has a gradient of exactly zero in exact arithmetic (softmax is
    # invariant to adding one constant to every score of a query): what arrives is rounding
    # noise, which Adam's g / sqrt(v) scales up to full-size steps, differently in every
    # summation order. No program can match it; every other parameter must.
    err = max(rel_err(full[n.removeprefix("model.")], p.detach())
              for n, p in ref.named_parameters() if not n.endswith("k_proj.bias"))
    return err, full
