"""Mesh search (solver/meshes.py): the candidates, the start, the search's record, and a
chosen mesh's plan that runs."""
from __future__ import annotations

import json

import pytest

from autoshard.tools.cli import main
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.plans.searches import named, searches
from autoshard.solver.meshes import (Candidate, candidates, microbatches_for, neighbours,
                                     search_mesh, start)
from autoshard.zoo.registry import load_model


def test_candidates_of_1024_h100s_for_gpt3_175b():
    """tp | 8 (in a node), pp <= 96 layers, dp | 1536; pp * dp * tp = 1024."""
    cands = candidates(1024, 8, 1536, 96)
    assert all(c.pp * c.dp * c.tp == 1024 for c in cands)
    assert {c.tp for c in cands} == {1, 2, 4, 8}
    assert all(1536 % c.dp == 0 and c.pp <= 96 for c in cands)
    # dp = 1024 (tp = pp = 1) does not divide the batch; pp = 128 or more exceeds the layers
    assert Candidate(1, 1024, 1) not in cands and not any(c.pp > 64 for c in cands)
    assert len(cands) == 27
    assert Candidate(16, 8, 8) in cands


def test_screening_microbatches():
    assert microbatches_for(Candidate(16, 8, 8), 1536) == 64       # 4p, 24 a microbatch / dp 8
    assert microbatches_for(Candidate(64, 2, 8), 1536) == 256
    assert microbatches_for(Candidate(1, 128, 8), 1536) is None    # no pipeline
    assert microbatches_for(Candidate(4, 4, 1), 12) == 0           # 16, 8, 4 leave dp 4 nothing
    assert microbatches_for(Candidate(2, 3, 1), 12) == 4           # 8 does not divide 12: 2p
    assert microbatches_for(Candidate(2, 2, 1), 12) == 2           # 12 / 4 = 3 rows: not dp 2


def test_start_is_megatrons_rule_of_thumb():
    """GPT-3 175B, 16 bytes of model state per parameter, 80 GB: 16 * 175e9 / (8 * pp) must
    fit 40 GB, so pp = 16 (8.75 rounded up to a candidate) with tensor 8."""
    cands = candidates(1024, 8, 1536, 96)
    assert start(cands, 175_000_000_000, 16.0, 80e9) == Candidate(16, 8, 8)
    # a model that fits without a pipeline starts unpipelined
    assert start(cands, 1_000_000_000, 16.0, 80e9) == Candidate(1, 128, 8)


def test_neighbours_double_or_halve_one_axis():
    cands = candidates(64, 8, 64, 32)
    got = {(c.pp, c.tp) for c in neighbours(Candidate(4, 4, 4), cands)}
    assert got == {(8, 4), (2, 4), (4, 8), (4, 2)}


def _search(**kw):
    model, inputs = load_model("gpt2-tiny-4l", batch=8, seq=8, device="meta")
    return search_mesh(model, inputs, 4, gpus_per_node=2, cluster="stress",
                       model_name="gpt2-tiny-4l", **kw)


@pytest.fixture(scope="module")
def searched():
    """The search over every candidate, done once: its plan is checked here and run on gloo
    below."""
    return _search()


def _mesh_tries(plan):
    """The tries of the mesh search's rounds, from the plan's record of its searches."""
    return [t for r in named(searches(plan.solver), "meshes", top=True) for t in r.tries]


def test_search_plans_every_candidate_of_a_small_model_and_keeps_the_fastest(searched):
    plan = searched
    ms = plan.solver["mesh_search"]
    tries = _mesh_tries(plan)
    screened = [t for t in tries if not t.changes.get("again")]
    assert ms["candidates"] == len(screened) and "tried" not in ms
    assert all(t.step_time_s is not None or t.error for t in tries)    # none left unplanned
    steps = [t.step_time_s for t in tries if t.step_time_s is not None]
    assert plan.predicted.step_time_s == min(steps)
    meshes = [(t.changes["mesh"]["pp"], t.changes["mesh"]["dp"], t.changes["mesh"]["tp"])
              for t in screened]
    assert all(tp <= 2 for _, _, tp in meshes)           # tensor inside a node of 2
    assert sorted(meshes) == sorted((c.pp, c.dp, c.tp) for c in candidates(4, 2, 8, 4))
    # Each round's kept try is its fastest; the plan's mesh is the fastest of all.
    for r in named(searches(plan.solver), "meshes"):
        kept = [t for t in r.tries if t.chosen]
        priced = [t.step_time_s for t in r.tries if t.step_time_s is not None]
        assert (kept and kept[0].step_time_s == min(priced)) or not priced
    best = min((t for t in tries if t.step_time_s is not None), key=lambda t: t.step_time_s)
    c = best.changes["mesh"]
    assert Candidate(c["pp"], c["dp"], c["tp"]).shape == plan.mesh_shape
    text = plan.summary()
    assert "mesh search over 4 devices (2 per node)" in text
    assert sum("<- chosen" in line for line in text.splitlines()) == 1


def test_a_spent_budget_plans_the_start_and_says_what_it_left():
    plan = _search(time_budget_s=0.0)
    tries = _mesh_tries(plan)
    assert len([t for t in tries if t.step_time_s is not None or t.error]) == 1
    left = [t for t in tries if t.step_time_s is None and t.error is None]
    assert left and not any(t.chosen for t in left)
    assert "not planned (time budget" in plan.summary()


@pytest.mark.slow
def test_chosen_plan_runs_on_gloo(searched):
    """The search's plan is an ordinary plan of its mesh: it verifies (loss, gradients, bytes)."""
    from autoshard.tools.verify import verify
    plan = searched
    mesh = Mesh(plan.mesh_shape, plan.mesh_axes, cluster="stress")
    ok, report = verify("gpt2-tiny-4l", mesh, plan=plan, batch=8, seq=8)
    assert ok, report


def test_bad_input(capsys):
    model, inputs = load_model("gpt2-tiny-4l", batch=8, seq=8, device="meta")
    with pytest.raises(AutoshardError, match="fills whole nodes of 8"):
        search_mesh(model, inputs, 12)
    with pytest.raises(AutoshardError, match="positive number of devices"):
        search_mesh(model, inputs, 0)
    with pytest.raises(AutoshardError, match="some data axis"):
        search_mesh(*load_model("gpt2-tiny-4l", batch=1, seq=8, device="meta"), 8,
                    gpus_per_node=1)        # 4 layers: dp 2 at least, and the batch is 1
    # 3 devices, no dimension 3 divides (batch 4, hidden 32, ...): said once, with the largest
    # count that splits something (each mesh used to fail alone, then "add devices")
    with pytest.raises(AutoshardError, match=r"no factor of 3 divides.*--gpus 2"):
        search_mesh(*load_model("gpt2-tiny-4l", batch=4, seq=8, device="meta"), 3,
                    gpus_per_node=4)
    with pytest.raises(SystemExit):
        main(["plan", "gpt2-tiny-4l", "--gpus", "4", "--mesh", "4"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["plan", "gpt2-tiny-4l", "--mesh", "4", "--gpus-per-node", "4"]) == 2
    assert "--gpus-per-node only with --gpus" in capsys.readouterr().err


def test_cli_search_writes_the_plan_and_show_prints_the_search(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt2-tiny-4l", "--gpus", "4", "--gpus-per-node", "2", "--cluster",
                 "stress", "--batch", "8", "--seq", "8", "-o", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["solver"]["mesh_search"]["gpus"] == 4
    assert any(r["search"] == "meshes" for r in saved["solver"]["searches"])
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert "<- chosen" in capsys.readouterr().out
