"""One JSON value of a plan file read through a check of its kind, and the error a missing or
ill-typed value raises (docs/plan-format.md). Loading a plan parses JSON and nothing else."""
from __future__ import annotations

import json
import reprlib
import sys
from typing import Any, NoReturn, Sequence

from autoshard.errors import AutoshardError
from autoshard.ir import Spec, parse_spec, replicated, spec_str

_REQUIRED = object()


class Malformed(AutoshardError):
    """A missing or ill-typed value of a plan file. ``Plan.loads`` turns it into its own error,
    naming the file (plans/fileformat.py); a part of a plan read alone (``Prediction.from_json``)
    raises it as it is."""

    def __init__(self, where: str, expected: str, got: str) -> None:
        super().__init__(f"{where} {expected}", got=got,
                         fix=f"correct {where} as docs/plan-format.md describes it")
        self.where, self.expected, self.got = where, expected, got


class Field:
    """One JSON value of a plan file and where it sits (``nodes[3].inputs[0]``), read through a
    check of its kind. JSON puts any type anywhere, bool passes for int and a float may be nan
    or inf: a bad value must fail here, named, not later inside summary() or the runtime."""

    __slots__ = ("value", "where")

    def __init__(self, value: Any, where: str) -> None:
        self.value, self.where = value, where

    def fail(self, expected: str) -> NoReturn:
        raise Malformed(self.where, expected, f"{self.where} = {reprlib.repr(self.value)}")

    def key(self, name: str, default: Any = _REQUIRED) -> "Field":
        obj, where = self.obj(), f"{self.where}.{name}".lstrip(".")
        if name not in obj and default is _REQUIRED:
            raise Malformed(where, "given", f"no key {name!r}")
        return Field(obj.get(name, default), where)

    def obj(self) -> dict:
        if not isinstance(self.value, dict):
            self.fail("a JSON object")
        return self.value

    def items(self) -> list[tuple[str, "Field"]]:
        return [(k, Field(v, f"{self.where}[{k!r}]")) for k, v in self.obj().items()]

    def entries(self, *, nonempty: bool = False) -> list["Field"]:
        if not isinstance(self.value, list) or (nonempty and not self.value):
            self.fail("a non-empty list" if nonempty else "a list")
        return [Field(v, f"{self.where}[{i}]") for i, v in enumerate(self.value)]

    def text(self, *, nonempty: bool = False) -> str:
        if not isinstance(self.value, str) or (nonempty and not self.value):
            self.fail("a non-empty string" if nonempty else "a string")
        return self.value

    def one_of(self, names: Sequence[str]) -> Any:
        """The text as the one of ``names`` it equals (an enum's members: autoshard/ir.py
        ``PlanName``), or a failure listing them."""
        if isinstance(self.value, str) and self.value in names:
            return names[list(names).index(self.value)]
        self.fail(f"one of {', '.join(map(json.dumps, names))}")

    def integer(self, *, least: int = 0) -> int:
        # Below 2**63, as every size and count is: a huge int overflows float arithmetic.
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int) or not least <= v < 2**63:
            self.fail(f"an integer from {least} to 2**63 - 1")
        return v

    def number(self) -> float:
        # The upper bound refuses inf and an int too large for a float; nan fails both bounds.
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= sys.float_info.max:
            self.fail("a finite number >= 0")
        return v

    def spec(self, ndim: int) -> Spec:
        try:
            spec = parse_spec(self.text())
        except ValueError:          # fail() shows the text; the parser's fix speaks to code
            spec = None
        if spec is None or len(spec) != ndim:
            self.fail(f"a spec with one placement (R, P or S(dim)) per mesh axis, like "
                      f"'{spec_str(replicated(ndim))}'")
        return spec
