"""Independent dropout masks per shard (issue 29: "Sharded dropout draws the same mask on every
shard when ranks are seeded alike"). On gloo, ranks seeded alike: a dropout over the rows of a
batch split over 2 data-parallel ranks draws a different mask on each; under tensor
parallelism the dropouts after the all-reduces (replicated) draw the same mask on both ranks,
while attention's dropout over heads split between them is seeded per shard; a training step
runs. (tests/test_modes.py runs verify's keep-all comparison through the seeded ops.)"""
from __future__ import annotations

import math

from dist import world_fixture
from modes import masks_drawn, plan_of

world2 = world_fixture(2, timeout_s=600)


def test_split_dropout_draws_a_mask_per_shard_and_replicas_agree(world2):
    """Data parallel: the two dropouts over the batch's rows are split (a mask per shard), the
    one on the replicated gain is not (the same mask on both replicas)."""
    plan = plan_of("mlp", (2,), "dp")
    a, b = world2.run(masks_drawn, "mlp", plan.dumps())
    assert a["split"] == b["split"] and sorted(a["split"]) == [False, True, True], a["split"]
    assert len(a["masks"]) == len(b["masks"]) == 3
    for split, x, y in zip(a["split"], a["masks"], b["masks"]):
        assert (x != y) if split else (x == y)
    assert math.isfinite(a["loss"]) and a["loss"] == b["loss"]


def test_sequence_parallel_dropouts_are_seeded_per_shard(world2):
    """Megatron with sequence parallelism: every dropout (attention's over the heads, the
    residual ones over the sequence) is split, and each shard's mask is its own."""
    plan = plan_of("gpt2", (2,), "megatron")
    a, b = world2.run(masks_drawn, "gpt2", plan.dumps())
    assert a["split"] == b["split"] and all(a["split"]), a["split"]
    assert a["masks"] and all(x != y for x, y in zip(a["masks"], b["masks"]))
    assert math.isfinite(a["loss"]) and a["loss"] == b["loss"]
