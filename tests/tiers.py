"""Write ``tests/slow.txt``: the tests a ``--durations=0`` run measured over a threshold, that
are not marked ``slow`` in their file already (tests/conftest.py marks the listed ones).

    python -m pytest -m "not slow" --durations=0 -p no:randomly > durations.txt
    python tests/tiers.py durations.txt --over 1.0

Measure on an idle machine: the threshold is seconds of one test (setup, call and teardown
together) there. Ids already in the list stay in it; remove a line by hand when its test got
cheaper.
"""
from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+)")


def durations(text: str) -> dict[str, float]:
    """Seconds per test id, its setup, call and teardown summed."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        m = LINE.match(line.strip())
        if m:
            out[m.group(3)] += float(m.group(1))
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("durations", help="the output of pytest --durations=0")
    ap.add_argument("--over", type=float, default=1.0, help="seconds (default 1.0)")
    args = ap.parse_args()
    path = Path(__file__).with_name("slow.txt")
    head = [line for line in path.read_text().splitlines() if line.startswith("#")] \
        if path.exists() else []
    kept = {line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")} if path.exists() else set()
    times = durations(Path(args.durations).read_text())
    new = {t for t, s in times.items() if s > args.over}
    path.write_text("\n".join(head + sorted(kept | new)) + "\n")
    print(f"{len(kept | new)} tests listed ({len(new - kept)} new)")


if __name__ == "__main__":
    main()
