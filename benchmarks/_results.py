"""Shared helpers of the benchmark scripts: the machine line, RESULTS.md sections, and one op
of a plan run alone as a rank runs it."""
from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import sys
from pathlib import Path

# Planning times here include tracing: no graph is reused from an earlier plan of the same model
# in this process (autoshard/trace/export.py). (The tests, which import these scripts, say "1".)
os.environ.setdefault("AUTOSHARD_TRACE_REUSE", "0")

HEADER = """# autoshard benchmark results

Each section below is (re)written by the benchmark script named in its markers; the scripts
keep every other section intact. See benchmarks/README.md for what each one measures.
"""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    import torch
    return (f"{platform.system()} {platform.release()} {platform.machine()}, {cpu_model()}, "
            f"{os.cpu_count()} logical CPUs; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def command(script: str) -> str:
    """The command line as typed from the repository root (no interpreter path)."""
    return "python " + shlex.join([script, *sys.argv[1:]])


def revision() -> str:
    """The git revision measured, and whether the working tree had changes."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               check=True).stdout.splitlines()
        # What the benchmarks write (RESULTS.md, their plots) measures nothing.
        dirty = [ln for ln in dirty if not ln[3:].startswith("benchmarks/")
                 or not ln.endswith((".md", ".png"))]
    except (OSError, subprocess.CalledProcessError):
        return "revision unknown"
    return f"revision {rev}" + (f" with uncommitted changes to {len(dirty)} tracked files"
                                if dirty else "")


def today() -> str:
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def cuda_device(script: str):
    """The first CUDA device, made current; None, having said so, where there is none."""
    import torch
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA device; torch.cuda.is_available() is False here. Run it "
              "on a GPU machine.", file=sys.stderr)
        return None
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def md_cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_section(path: str | Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in ``path``
    (appending the section if absent, creating the file with a header if missing)."""
    path = Path(path)
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else HEADER
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text if text.endswith("\n") else text + "\n")


def timing(plan, key: str) -> float:
    """A wall-clock figure of a plan (trace_s, build_s, solve_s): ``Plan.timings`` where the
    planner keeps them, else the older ``Plan.solver`` keys (``seconds`` for the solve)."""
    t = getattr(plan, "timings", None) or {}
    if key in t:
        return float(t[key])
    s = plan.solver
    return float(s["seconds"] if key == "solve_s" and "solve_s" not in s else s[key])


def node_strategies(plan) -> dict:
    """The plan's strategy per node, as the planner priced them."""
    from autoshard.ir import Strategy, work_fraction
    shape = tuple(plan.mesh_shape)
    return {n.name: Strategy(tuple(n.inputs), tuple(n.outputs), n.kernel,
                             work_fraction(tuple(n.inputs), tuple(n.outputs), shape))
            for n in plan.nodes}


def local_call(node, strategy, mesh_shape: tuple, coords: tuple, make, device=None):
    """Op ``node`` of a traced graph as the rank at ``coords`` runs it under ``strategy``: its
    kernel (an op's own collectives left local: they are priced and timed as collectives) and
    arguments, each tensor argument ``make(arg_node, value, local_shape)``, a factory's device
    ``device`` where given. Returns ``(fn, args, kwargs, tensors made)``."""
    import torch
    from autoshard.ir import local_shape
    from autoshard.ops.registry import CollectiveKernel, localize
    from autoshard.trace.export import op_info
    op = op_info(node)
    specs = list(strategy.inputs) if len(strategy.inputs) == len(op.inputs) else [
        s for s in strategy.inputs if s is not None]
    tensors: list = []

    def real(a):
        if device is not None and isinstance(a, torch.device):
            return device
        if not isinstance(a, torch.fx.Node):
            return a
        v = a.meta["val"]
        spec = specs[len(tensors)] if len(tensors) < len(specs) else None
        shape = tuple(v.shape) if spec is None else local_shape(tuple(v.shape), spec, mesh_shape)
        tensors.append(make(a, v, shape))
        return tensors[-1]

    args = torch.fx.node.map_aggregate(node.args, real)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, real)
    fn, args, kwargs = localize(op, strategy, mesh_shape, coords, args, kwargs)
    if isinstance(fn, CollectiveKernel):
        fn = fn.bind(lambda x, how: x)
    return fn, args, kwargs, tensors
