"""pm.train() / pm.eval() as model.train() / model.eval() (issue 29, "Modes and outputs").

On gloo, under data parallelism, tensor parallelism (Megatron) and ZeRO-2/ZeRO-3, for HF GPT-2
and Llama at tiny sizes with dropout 0.1 and a batch-norm model: a training step, two
evaluations, a training step, against the same on one device. Eval losses equal
``model.eval()``'s within 1e-5 (dropout off, batch norm on its running statistics), evaluation
leaves the running statistics as they were, and training afterwards equals one device again
(its dropout draws made keep-all by verify's dispatch mode on both sides: a rank draws its own
masks, so no seed makes them one device's).
"""
from __future__ import annotations

import pytest

from dist import world_fixture
from modes import plan_of, train_eval_train

world2 = world_fixture(2, timeout_s=600)

CASES = [(kind, baseline, kw) for kind in ("gpt2", "llama", "bn") for baseline, kw in (
    ("dp", {}), ("megatron", {}), ("dp", dict(zero="zero2", bucket_mb=0.05)), ("fsdp", {}))
    if not (kind == "bn" and baseline == "megatron")]


@pytest.mark.parametrize("kind,baseline,kw", CASES,
                         ids=[f"{k}-{b}{'-zero2' if kw else ''}" for k, b, kw in CASES])
def test_eval_and_train_modes_equal_one_device(world2, kind, baseline, kw):
    plan = plan_of(kind, (2,), baseline, **kw)
    for out in world2.run(train_eval_train, kind, plan.dumps()):
        assert out["modes"] == (False, False), out
        eval_err = max(abs(a - b) / abs(b) for a, b in zip(out["loss"][1:3], out["ref"][1:3]))
        assert eval_err <= 1e-5, out
        train_err = max(abs(a - b) / abs(b) for a, b in zip(out["loss"][::3], out["ref"][::3]))
        assert train_err <= 1e-5, out
        assert out["grad_err"] <= 1e-5, out
        assert out["eval_kept_buffers"] and out["buffer_err"] <= 1e-6, out
        assert out["has_buffers"] == (kind == "bn"), out
