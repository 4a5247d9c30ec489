"""examples/train.py, the loop the README points users to, run as they run it: under torchrun on
gloo, pipelined (parameter groups, accumulation, clipping, evaluation between steps, a DCP
checkpoint), then resumed from its checkpoint. tests/test_training_loop.py holds the numbers of
each part against one device; this says the recipe itself runs end to end."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"


def _torchrun(*args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(EXAMPLE), "--mesh", "2", "--axes", "pp",
           "--pipeline", "pp", "--layers", "2", "--hidden", "32", "--heads", "2",
           "--vocab", "64", "--seq", "16", "--batch", "4", "--log-every", "1", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_recipe_trains_evaluates_checkpoints_and_resumes_pipelined(tmp_path):
    """Why: its own pipelined run (--pipeline pp) failed at its first evaluation."""
    ckpt = str(tmp_path / "ckpt")
    first = _torchrun("--steps", "2", "--eval-every", "2", "--ckpt-dir", ckpt,
                      "--ckpt-every", "2")
    assert re.search(r"step +2 +eval loss \d", first), first
    assert f"checkpoint {ckpt}/step2" in first, first
    then = _torchrun("--steps", "3", "--eval-every", "0", "--ckpt-dir", ckpt, "--resume")
    assert f"resumed from {ckpt}/step2 at step 2" in then, then
    assert re.search(r"step +3 +loss \d", then), then
