"""User mistakes end in an AutoshardError that says what was expected, what was got and how to
fix it (docs/design.md, "Errors"), and the CLI prints it on one line and exits 2: hand-edited
plan files and cluster profiles, factory files, zoo arguments, models torch.export cannot
capture, and `autoshard verify` given a plan it cannot run. tests/test_fuzz.py checks the file
loaders on random damage; this file pins each hole found, by fuzzing or by report.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

import autoshard
import autoshard.tools.verify
from autoshard.tools.cli import main
from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.plans import Plan
from autoshard.trace.export import trace
from autoshard.zoo.registry import get_model, load_factory, load_model


def refused(fn: Callable[[], Any], *fragments: str) -> str:
    """The message of the AutoshardError ``fn()`` raises, checked for its parts."""
    with pytest.raises(AutoshardError) as info:
        fn()
    msg = str(info.value)
    assert "; got " in msg and ". Fix: " in msg, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    return msg


def cli_refused(capsys, argv: list[str], *fragments: str) -> str:
    """``autoshard argv`` exits 2 with one line on stderr holding ``fragments``."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


# ------------------------------------------------------------------------------ plan files

@pytest.fixture(scope="module")
def plan_doc() -> dict:
    model, inputs = get_model("mlp-tiny", device="meta")
    return json.loads(autoshard.plan(model, inputs, Mesh((2,), cluster="stress")).dumps())


def _edited(doc: dict, edit: Callable[[dict], None]) -> str:
    d = json.loads(json.dumps(doc))
    edit(d)
    return json.dumps(d)


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """An edit setting ``d[k1][k2]...`` (keys split on '/', digits index lists)."""
    *parents, last = [int(k) if k.isdigit() else k for k in path.split("/")]

    def edit(d: dict) -> None:
        for k in parents:
            d = d[k]
        d[last] = value
    return edit


# A hand-edited mesh: each was accepted, or failed later as a bare exception.
MESH_EDITS = {
    "two axis names for one size": (_set("mesh/axes", ["a", "b"]), "mesh.axes"),
    "negative size (was accepted)": (_set("mesh/shape", [-2]), "mesh.shape[0]"),
    "zero size (ZeroDivisionError in summary)": (_set("mesh/shape", [0]), "mesh.shape[0]"),
    "size as a string (was read as 2)": (_set("mesh/shape", ["2"]), "mesh.shape[0]"),
    "fractional size (was cut to 2)": (_set("mesh/shape", [2.5]), "mesh.shape[0]"),
    "true as a size (was read as 1)": (_set("mesh/shape", [True]), "mesh.shape[0]"),
    "infinite size (OverflowError)": (_set("mesh/shape", [float("inf")]), "mesh.shape[0]"),
    "axis name not a string (TypeError)": (_set("mesh/axes", [1]), "mesh.axes[0]"),
    "axis named twice": (_set("mesh", {"shape": [2, 1], "axes": ["x", "x"]}), "mesh.axes"),
}


@pytest.mark.parametrize("case", sorted(MESH_EDITS))
def test_a_hand_edited_mesh_is_refused_at_load(plan_doc, case: str) -> None:
    edit, where = MESH_EDITS[case]
    refused(lambda: Plan.loads(_edited(plan_doc, edit), source="plan.json"),
            "plan.json", "malformed", where, f"correct {where} as docs/plan-format.md")


# Found by tests/test_fuzz.py: loaded, then failed inside summary() or as another exception.
FIELD_EDITS = {
    "bytes inf (OverflowError)": (_set("collectives/0/bytes", float("inf")), "collectives[0].bytes"),
    "bytes as text (was accepted)": (_set("collectives/0/bytes", "512"), "collectives[0].bytes"),
    "phase not a string (TypeError sorting in summary)": (_set("collectives/0/phase", 3),
                                                          "collectives[0].phase"),
    "phase not the step's (was accepted)": (_set("collectives/0/phase", "sideways"),
                                            "collectives[0].phase one of \"forward\""),
    "figure as text (TypeError in summary)": (_set("predicted/step_time_s", "1"),
                                              "predicted.step_time_s"),
    "figure huge (OverflowError in summary)": (_set("predicted/comm_s", 10**400),
                                               "predicted.comm_s"),
    "figure missing (KeyError in summary)": (lambda d: d["predicted"].pop("comm_s"),
                                             "predicted.comm_s"),
    "gap as text (ValueError in summary)": (_set("solver/gap", "0"), "solver.gap"),
    "status missing (KeyError in summary)": (lambda d: d["solver"].pop("status"),
                                             "solver.status"),
    "layer name not a string (AttributeError in summary)": (_set("layers/0/name", True),
                                                            "layers[0].name"),
    "layer of another plan": (_set("layers/1/same_as", "blocks.9"), "layers[1].same_as"),
    "layer name without its number (IndexError in summary)": (
        lambda d: [layer.update(name="layers") for layer in d["layers"]], "layers[0].name"),
    "spec for another mesh": (_set("params/layers.0.fc.bias/placements", "[R, R]"),
                              "params['layers.0.fc.bias'].placements"),
    "input shape negative (was accepted)": (_set("inputs/input0/shape", [-8, 16]),
                                            "inputs['input0'].shape[0]"),
    "input renamed": (lambda d: d["inputs"].update(x=d["inputs"].pop("input0")), "inputs"),
    "node listed twice": (lambda d: d["nodes"].append(d["nodes"][0]), "a node name used once"),
    "huge memory budget (OverflowError in PlanOptions)": (_set("options/memory_budget", 10**400),
                                                          "options"),
}


@pytest.mark.parametrize("case", sorted(FIELD_EDITS))
def test_a_damaged_plan_field_is_refused_at_load(plan_doc, case: str) -> None:
    edit, where = FIELD_EDITS[case]
    refused(lambda: Plan.loads(_edited(plan_doc, edit), source="plan.json"), "malformed", where)


@pytest.mark.parametrize("text", ["1" * 5000, "[" * 100_000],
                         ids=["int of 5000 digits (ValueError)", "deep nesting (RecursionError)"])
def test_json_the_parser_refuses_is_refused(text: str) -> None:
    refused(lambda: Plan.loads(text, source="plan.json"), "JSON", "plan.json")


def test_a_binary_plan_file_is_refused(tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(b"\x80\xff plan")                 # UnicodeDecodeError before
    refused(lambda: Plan.load(path), "a readable plan file", str(path))
    cli_refused(capsys, ["show", str(path)], "a readable plan file")


def test_show_of_a_hand_edited_mesh_is_one_line(plan_doc, tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.json"
    path.write_text(_edited(plan_doc, _set("mesh/shape", [0])))
    cli_refused(capsys, ["show", str(path)], str(path), "mesh.shape[0]")


def test_inputs_keep_their_positions_past_ten(tmp_path: Path) -> None:
    """The file's keys are sorted as text (input10 before input2): loading restores positions."""
    class ManyInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, *xs: torch.Tensor) -> torch.Tensor:
            return sum(self.fc(x).sum() for x in xs)

    xs = tuple(torch.randn(2 * (i + 1), 4) for i in range(11))
    plan = autoshard.plan(ManyInputs(), xs, Mesh((2,), cluster="cpu"))
    again = Plan.loads(plan.dumps())
    assert list(again.inputs) == list(plan.inputs) == [f"input{i}" for i in range(11)]
    assert [t.shape[0] for t in again.example_inputs()] == [x.shape[0] for x in xs]


# ------------------------------------------------------------------------------ cluster profiles

@pytest.mark.parametrize("body, fragment", [
    (b"\x80\xff", "readable JSON"),                                 # UnicodeDecodeError before
    (b"1" * 5000, "readable JSON"),                                 # ValueError before
    (b"[" * 100_000, "readable JSON"),                              # RecursionError before
    (json.dumps({"flops": 10**400}).encode(), "'flops'"),           # OverflowError before
    (json.dumps({"flops": -1}).encode(), "'flops'"),
], ids=["binary", "5000 digits", "deep nesting", "huge int", "negative"])
def test_a_bad_cluster_profile_is_refused_naming_the_file(tmp_path: Path, body: bytes,
                                                          fragment: str) -> None:
    path = tmp_path / "lab.json"
    path.write_bytes(body)
    refused(lambda: Cluster.load(path), fragment, str(path))
    refused(lambda: Mesh((2,), cluster=str(path)), fragment, str(path))


# ------------------------------------------------------------------------------ factory files

_BUILD = "import torch\nfrom torch import nn\n"

FACTORIES = {
    "syntax error": ("def build(:\n    pass\n", "SyntaxError"),
    "failing import": ("import no_such_module_here\n", "ModuleNotFoundError"),
    "exits at import": ("import sys\nsys.exit(3)\n", "SystemExit"),
    "no factory of that name": (_BUILD + "def other():\n    pass\n", "no such function"),
    "factory raises": ("def build():\n    raise RuntimeError('boom')\n", "RuntimeError: boom"),
    "factory takes arguments": ("def build(n):\n    pass\n", "called with no arguments"),
    "returns None": ("def build():\n    pass\n", "got an object of type NoneType"),
    "returns the model only": (_BUILD + "def build():\n    return nn.Linear(2, 2)\n",
                               "got an object of type Linear"),
    "returns no inputs": (_BUILD + "def build():\n    return nn.Linear(2, 2), ()\n",
                          "example_inputs a tuple of ()"),
}


@pytest.mark.parametrize("case", sorted(FACTORIES))
def test_a_bad_factory_file_says_what_was_expected(tmp_path: Path, case: str) -> None:
    text, fragment = FACTORIES[case]
    path = tmp_path / "my_model.py"
    path.write_text(text)
    refused(lambda: load_factory(f"{path}:build"), fragment)


def test_a_missing_or_misnamed_factory_file(tmp_path: Path) -> None:
    refused(lambda: load_factory(f"{tmp_path / 'nope.py'}:build"), "no such file")
    (tmp_path / "model.txt").write_text("def build(): pass\n")     # AssertionError before
    refused(lambda: load_factory(f"{tmp_path / 'model.txt'}:build"), "path/to/file.py:function")


def test_a_factory_error_is_one_line_on_the_cli(tmp_path: Path, capsys) -> None:
    path = tmp_path / "my_model.py"
    path.write_text("from autoshard.errors import AutoshardError\n"
                    "def build():\n"
                    "    raise AutoshardError('a model', got='two\\nlines', fix='none')\n")
    cli_refused(capsys, ["plan", f"{path}:build", "--mesh", "2"], "two lines")
    cli_refused(capsys, ["plan", f"{path}:build", "--mesh", "2", "--batch", "8"],
                "zoo models only")                  # --batch was silently ignored


@pytest.mark.parametrize("name, batch, seq, fragment", [
    ("gpt2-tiny", 2.5, None, "batch=2.5"), ("gpt2-tiny", True, None, "batch=True"),
    ("gpt2-tiny", None, "4", "seq='4'"), (["gpt2-tiny"], None, None, "a string"),
    (None, None, None, "a string"),
])
def test_zoo_arguments_of_the_wrong_type(name: Any, batch: Any, seq: Any, fragment: str) -> None:
    # A TypeError from torch.randint, or from hashing a list, before.
    refused(lambda: get_model(name, batch=batch, seq=seq), fragment)
    refused(lambda: load_model(name, batch=batch, seq=seq, device="meta"), fragment)


# ------------------------------------------------------------------------------ trace

class _Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


class DictOut(_Lin):
    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": self.fc(x)}


class TupleOut(_Lin):
    def forward(self, x: torch.Tensor) -> tuple:
        return self.fc(x), x


class Classifier(_Lin):
    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        return F.cross_entropy(self.fc(x), target)


class Branchy(_Lin):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y.sum() if y.sum() > 0 else -y.sum()


class Masked(_Lin):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[x[:, 0] > 0].sum()     # value-sized: fails after export, not in it


X = torch.randn(8, 4)
# Each common cause of an export failure: (model, inputs, what the message says, the cause).
EXPORT_FAILURES = {
    "wrong number of inputs": (lambda: get_model("gpt2-tiny")[0],
                               lambda: (*get_model("gpt2-tiny")[1], X),
                               "match the parameters of forward", TypeError),
    "a dict input": (DictOut, lambda: ({"x": X},), "not dicts", TypeError),
    "a dict output for training": (DictOut, lambda: (X,), "one scalar loss", AutoshardError),
    "a tuple output for training": (TupleOut, lambda: (X,), "one scalar loss", AutoshardError),
    "no target": (Classifier, lambda: (X,), "end with the target (labels)", TypeError),
    "a None target": (Classifier, lambda: (X, None), "end with the target (labels)", TypeError),
    "branch on a value": (Branchy, lambda: (X,), "do not depend on tensor values",
                          GuardOnDataDependentSymNode),
    "mask indexing": (Masked, lambda: (X,), "do not depend on tensor values",
                      GuardOnDataDependentSymNode),
}


@pytest.mark.parametrize("case", sorted(EXPORT_FAILURES))
def test_each_export_failure_names_its_own_fix(case: str) -> None:
    make_model, make_inputs, fragment, cause = EXPORT_FAILURES[case]
    with pytest.raises(AutoshardError) as info:
        trace(make_model(), make_inputs())
    assert fragment in str(info.value), str(info.value)
    assert isinstance(info.value.__cause__, cause)         # the original stays chained


def test_export_fixes_differ_by_cause() -> None:
    fixes = {}
    for case, (make_model, make_inputs, _, _) in EXPORT_FAILURES.items():
        with pytest.raises(AutoshardError) as info:
            trace(make_model(), make_inputs())
        fixes[case] = info.value.fix
    # One fix per cause (the two target cases, and the two value-dependence cases, share one).
    assert len(set(fixes.values())) == 5, fixes
    assert not any("use_cache" in fix for fix in fixes.values())


class ScalesByAValue(_Lin):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * x.abs().max().item()).sum()


def test_a_check_of_a_value_is_dropped_and_a_value_read_as_a_number_is_refused() -> None:
    """A model's assertion on a value read off a tensor (XLM's ``lengths.max().item() <=
    slen``) exports as ``item``, ``lt`` and ``_assert_scalar``: it changes no value, so the
    trace drops it and the model plans (a raw AssertionError from inside the tracer before).
    A number read off a tensor and used as an operand is refused, naming the op and the line."""
    model, inputs = load_factory(f"{Path(__file__).parent / 'data' / 'value_check_model.py'}"
                                 ":make")
    traced = trace(model, inputs)
    assert not [n for n in traced.graph.nodes if "item" in str(n.target)
                or "assert_scalar" in str(n.target)]
    assert autoshard.plan(model, inputs, Mesh((2,))).predicted.step_time_s > 0
    with pytest.raises(AutoshardError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")          # (max and item have no rule: said first)
        autoshard.plan(ScalesByAValue(), (X,), Mesh((2,)))
    text = str(info.value)
    assert "numbers read off tensors" in text and "item" in text, text
    assert "test_errors.py" in text and ".item()" in text, text


class NoneMask(_Lin):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return (self.fc(x) * mask[:, None]).sum()


def test_an_export_failure_names_the_models_line() -> None:
    """Switch Transformers' encoder indexes an attention mask that is None under export: the
    message blamed missing labels ("NoneType" anywhere read as a missing target) and named no
    place; it names the model's own line that failed."""
    with pytest.raises(AutoshardError) as info:
        trace(NoneMask(), (X,))
    text = str(info.value)
    assert "end with the target" not in text, text
    assert "(at test_errors.py:" in text and "mask[:, None]" in text, text


@pytest.mark.parametrize("inputs, fragment", [
    ((torch.zeros(0, 4),), "input0 of shape [0, 4]"),           # was planned without a word
    ({"x": X}, "a dict with keys ['x']"),                        # tuple() gave its keys
    (X, "(x,)"),                                                 # tuple() gave its rows
], ids=["zero-size batch", "dict of inputs", "bare tensor"])
def test_example_inputs_are_checked_before_export(inputs: Any, fragment: str) -> None:
    refused(lambda: trace(DictOut(), inputs, training=False), fragment)


# ------------------------------------------------------------------------------ CLI

def test_an_unwritable_output_is_one_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "no_such_dir" / "p.json"                    # FileNotFoundError before
    cli_refused(capsys, ["plan", "mlp-tiny", "--mesh", "2", "-o", str(out)], "writable", str(out))


@pytest.fixture
def no_ranks(monkeypatch) -> None:
    """Fail a test that would spawn gloo ranks: these refusals must come first."""
    def world(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("verify spawned ranks before refusing")
    monkeypatch.setattr(autoshard.tools.verify, "World", world)


def test_verify_refuses_a_plan_for_another_batch_before_spawning(tmp_path: Path, capsys,
                                                                 no_ranks) -> None:
    path = str(tmp_path / "p.json")
    assert main(["plan", "gpt2-tiny", "--mesh", "2", "--batch", "4", "--cluster", "stress",
                 "-o", path]) == 0
    capsys.readouterr()
    err = cli_refused(capsys, ["verify", "gpt2-tiny", "--mesh", "2", "--batch", "8",
                               "--plan", path], "a plan made for this model", "re-plan")
    assert "[4, 16, 32]" in err and "[8, 16, 32]" in err and "Traceback" not in err


def test_verify_refuses_a_forward_only_plan_before_spawning(tmp_path: Path, capsys,
                                                            no_ranks) -> None:
    path = str(tmp_path / "p.json")
    assert main(["plan", "gpt2-tiny", "--mesh", "2", "--inference", "--cluster", "stress",
                 "-o", path]) == 0
    capsys.readouterr()
    cli_refused(capsys, ["verify", "gpt2-tiny", "--mesh", "2", "--plan", path], "forward-only")
    cli_refused(capsys, ["verify", "gpt2-tiny", "--mesh", "2", "--plan", path, "--baseline",
                         "dp"], "not both")


_RANKS_ONLY = """
import torch.distributed as dist
from autoshard.errors import AutoshardError
from autoshard.zoo.registry import get_model

def build():
    if dist.is_initialized():
        raise AutoshardError("a factory that builds on every rank", got="a refusal on a rank",
                             fix="build the same model everywhere")
    return get_model("mlp-tiny", device="cpu")
"""


def test_a_mistake_found_on_the_ranks_is_one_line(tmp_path: Path, capsys) -> None:
    """Spawns two gloo ranks: a refusal there comes back as the CLI's one line, not a
    RankError holding tracebacks."""
    path = tmp_path / "ranks_only.py"
    path.write_text(_RANKS_ONLY)
    err = cli_refused(capsys, ["verify", f"{path}:build", "--mesh", "2"],
                      "a factory that builds on every rank", "(on the gloo ranks)")
    assert "Traceback" not in err
