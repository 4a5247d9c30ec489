"""The package's size limits (issue 27): no module over 700 lines, no class over 300, no function
over 80, so that each module holds one concept a newcomer can read at once. The source is read
with ``ast``, not imported. Every exception is listed below with its reason."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "autoshard"

MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 700, 300, 80

# (path relative to autoshard/, kind, name) -> why it may exceed its limit for now. Empty: every
# module, class and function is within its limit. An entry needs its reason; a new violation
# fails, and so does an entry that no longer exceeds (remove it then).
ALLOWED: dict[tuple[str, str, str], str] = {}


def _spans(tree: ast.Module):
    """(kind, qualified name, lines) of every class and function, nested ones included."""
    def walk(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                yield "class", name, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield "function", name, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
    yield from walk(tree, "")


def violations(root: Path = PKG) -> dict[tuple[str, str, str], int]:
    """Every module, class and function of ``root`` over its limit, with its length in lines."""
    limit = {"module": MODULE_LINES, "class": CLASS_LINES, "function": FUNCTION_LINES}
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            out[(rel, "module", "")] = lines
        for kind, name, n in _spans(ast.parse(text, filename=str(path))):
            if n > limit[kind]:
                out[(rel, kind, name)] = n
    return out


def test_no_module_class_or_function_over_its_limit() -> None:
    found = violations()
    new = {k: n for k, n in found.items() if k not in ALLOWED}
    assert not new, "over the limits (split by concern, or list in ALLOWED with the reason):\n" \
        + "\n".join(f"  {p} {kind} {name} {n} lines" for (p, kind, name), n in sorted(new.items()))
    stale = sorted(k for k in ALLOWED if k not in found)
    assert not stale, f"ALLOWED lists what is within the limits now; remove: {stale}"


def test_the_checker_finds_each_kind(tmp_path: Path) -> None:
    # A checker that never fails proves nothing: a tree with one violation of each kind.
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    method = "\n".join(f"        y{i} = {i}" for i in range(10))
    methods = "\n".join(f"    def m{k}(self):\n{method}" for k in range(CLASS_LINES // 11 + 1))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text(
        f"def long():\n{body}\n\n\nclass Wide:\n{methods}\n" + "\n" * MODULE_LINES)
    (tmp_path / "pkg" / "small.py").write_text("def f():\n    return 1\n")
    found = violations(tmp_path / "pkg")
    assert set(found) == {("big.py", "module", ""), ("big.py", "function", "long"),
                          ("big.py", "class", "Wide")}
    assert found[("big.py", "function", "long")] == FUNCTION_LINES + 1


def test_each_exception_says_why() -> None:
    assert all(why.strip() for why in ALLOWED.values()), ALLOWED


# ------------------------------------------------------------------ docs/design.md's package map

DESIGN = ROOT / "docs" / "design.md"
MAP_BEGIN, MAP_END = "<!-- package map: begin -->", "<!-- package map: end -->"


def map_entries(text: str) -> list[str]:
    """The paths docs/design.md's map names, relative to the repository root: a package as
    ``autoshard/ops/`` (its folder), a module as ``autoshard/ops/view.py``. Two spaces of
    indent per level; the first word of a line is the name."""
    if MAP_BEGIN not in text or MAP_END not in text:
        raise AssertionError(f"docs/design.md has no package map between {MAP_BEGIN} and "
                             f"{MAP_END}")
    block = text.split(MAP_BEGIN, 1)[1].split(MAP_END, 1)[0]
    stack: list[str] = []
    out = []
    for line in block.splitlines():
        if not line.strip() or line.startswith("```"):
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        stack = stack[:depth]
        out.append("".join(stack) + name)
        if name.endswith("/"):
            stack.append(name)
    return out


def package_tree(root: Path = ROOT) -> list[str]:
    """Every package (a folder with __init__.py) and module under root/autoshard, as the map
    names them; a package's __init__.py is the package itself."""
    out = []
    for path in sorted((root / "autoshard").rglob("*.py")):
        rel = path.relative_to(root)
        if path.name == "__init__.py":
            out.append(rel.parent.as_posix() + "/")
        else:
            out.append(rel.as_posix())
    return out


def map_problems(entries: list[str], tree: list[str]) -> list[str]:
    named, have = set(entries), set(tree)
    twice = sorted({e for e in entries if entries.count(e) > 1})
    return ([f"named in the map but not in the folders: {e}" for e in entries if e not in have]
            + [f"in the folders but not in the map: {t}" for t in tree if t not in named]
            + [f"named twice in the map: {e}" for e in twice])


def test_design_map_matches_the_folders() -> None:
    problems = map_problems(map_entries(DESIGN.read_text(encoding="utf-8")), package_tree())
    assert not problems, "docs/design.md's package map and autoshard/ disagree (update the " \
        "map):\n  " + "\n  ".join(problems)


def test_map_check_on_a_known_tree(tmp_path: Path) -> None:
    for name in ("autoshard/__init__.py", "autoshard/ir.py", "autoshard/cost/__init__.py",
                 "autoshard/cost/comm.py", "autoshard/cost/new.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    text = (f"x\n{MAP_BEGIN}\n```\nautoshard/   facade\n  ir.py   the IR\n  cost/   costs\n"
            f"    comm.py   collectives\n    gone.py   removed\n```\n{MAP_END}\n")
    entries = map_entries(text)
    assert entries == ["autoshard/", "autoshard/ir.py", "autoshard/cost/",
                       "autoshard/cost/comm.py", "autoshard/cost/gone.py"]
    assert map_problems(entries, package_tree(tmp_path)) == [
        "named in the map but not in the folders: autoshard/cost/gone.py",
        "in the folders but not in the map: autoshard/cost/new.py"]
