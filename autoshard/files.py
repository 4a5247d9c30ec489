"""Writing the files the tools make (plans, reports, exported modules, cluster profiles).

Two promises: a tool never writes over a file it reads (``autoshard report plan.json -o
plan.json`` would replace the plan with its own HTML), and an output appears whole or not at
all: it is written beside its destination and renamed onto it (``os.replace``, atomic on
POSIX and Windows within one file system), so an interrupted or failed write leaves the
previous file as it was, and a reader never sees half a plan.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable

from autoshard.errors import AutoshardError


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output(output: str | Path, inputs: Iterable[tuple[str, str | Path]], *,
                 flag: str = "-o", suffix: str = "") -> None:
    """Refuse ``output`` when it is one of ``inputs`` ((what, path) pairs: the files the command
    reads), through links and relative paths as well. ``suffix``: the output's kind (".html"),
    for the path the fix suggests."""
    out = Path(output)
    for what, path in inputs:
        src = Path(path)
        if _same_file(out, src) or out.resolve() == src.resolve():
            raise AutoshardError(f"an output path ({flag}) that is not a file the command reads",
                                 got=f"{flag} {output}, which is the {what} it reads",
                                 fix=f"write to another path, e.g. {flag} "
                                     f"{_other_name(out, suffix)}")


def _other_name(out: Path, suffix: str) -> str:
    if suffix and out.suffix != suffix:
        return str(out.with_suffix(suffix))
    return str(out.with_name(f"{out.stem}.out{out.suffix}"))


def model_files(model: str) -> list[tuple[str, str]]:
    """The files a model spec reads: ``path/to/file.py:factory``'s file, a Hugging Face
    config.json or the config.json of a directory (zoo names read none)."""
    path = model.rsplit(":", 1)[0] if ":" in model and model.split(":", 1)[0].endswith(".py") \
        else model
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    return [("model file", str(p))] if p.is_file() else []


def write_output(path: str | Path, text: str, *, what: str, flag: str = "-o") -> None:
    """Write ``text`` to ``path`` atomically: a temporary file in the same directory, renamed
    onto ``path`` once complete. The file keeps the mode an existing one had (else the umask's
    default). ``what`` names the output in the error a failed write raises."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777 if path.exists() else _default_mode()
        fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".",
                                   prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise AutoshardError(f"a writable path for the {what} ({flag})",
                             got=f"{path}: {e.strerror or e}",
                             fix="write into an existing directory you may write to") from e


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
