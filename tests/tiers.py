"""Write the test tiers' lists from a ``--durations=0`` run (tests/conftest.py reads them):

- ``tests/slow.txt``: the tests of the fast tier measured over ``--over`` seconds; they are
  marked ``slow`` and leave the fast tier (``-m "not slow"``), not the README's command.
- ``tests/extended.txt``: the tests of the README's command measured over ``--extended-over``
  seconds; they are marked ``full`` and run only with ``AUTOSHARD_SLOW=1`` (CI runs them after
  the README's command), except those :data:`STANDARD` keeps.

    python -m pytest -m "not slow" --durations=0 > fast.txt
    python tests/tiers.py fast.txt --over 0.5
    python -m pytest --durations=0 > readme.txt
    python tests/tiers.py readme.txt --extended-over 5

Measure on an idle 2-core machine, each list from a run of the tier it cuts: a threshold is
seconds of one test (setup, call and teardown together) in that run. Ids already in a list stay
in it; remove a line by hand when its test got cheaper.
"""
from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+)")

# Tests over the extended threshold that the README's command keeps: each is the only test there
# of what it checks on a multi-process world.
STANDARD = {
    # parameters streamed from the host, stepped against the device twin
    "tests/test_param_offload.py::test_gpt2_streamed_steps_as_its_device_twin",
    # a Hugging Face MoE with tokens and experts split, equal to one device
    "tests/test_unseen.py::test_tokens_and_experts_split_on_gloo[qwen3_moe-weights0]",
    # the compiled rank program against the eager one, collectives inside
    "tests/test_ring.py::test_compiled_program_with_the_ring_equals_the_eager_one",
    # attention over a split sequence with K and V all-gathered, equal to one device
    "tests/test_context.py::test_context_parallel_equals_single_device[cp2x2]",
    # the vocabulary-parallel cross-entropy, equal to one device
    "tests/test_vocab_parallel.py::test_vocab_parallel_plan_equals_single_device[gpt2-tiny-2x2-2]",
    # strided shards of a fused projection, equal to one device
    "tests/test_strided.py::test_a_fused_qkv_viewed_into_heads_trains_as_one_device_on_gloo",
}


def durations(text: str) -> dict[str, float]:
    """Seconds per test id, its setup, call and teardown summed."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        m = LINE.match(line.strip())
        if m:
            out[m.group(3)] += float(m.group(1))
    return dict(out)


def listed(name: str) -> tuple[list[str], set[str]]:
    """The comment lines and the test ids of the list ``tests/<name>``."""
    path = Path(__file__).with_name(name)
    lines = path.read_text().splitlines() if path.exists() else []
    return ([line for line in lines if line.startswith("#")],
            {line.strip() for line in lines if line.strip() and not line.startswith("#")})


def write(name: str, new: set[str], drop: set[str] = frozenset()) -> None:
    """Add ``new`` to the list ``tests/<name>``, keeping its comment lines and ids, less
    ``drop``."""
    head, kept = listed(name)
    ids = (kept | new) - drop
    Path(__file__).with_name(name).write_text("\n".join(head + sorted(ids)) + "\n")
    print(f"{name}: {len(ids)} tests listed ({len(new - kept - drop)} new)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("durations", help="the output of pytest --durations=0")
    ap.add_argument("--over", type=float, help="seconds: list the tests over it in slow.txt")
    ap.add_argument("--extended-over", type=float,
                    help="seconds: list the tests over it in extended.txt")
    args = ap.parse_args()
    if args.over is None and args.extended_over is None:
        ap.error("say --over, --extended-over or both")
    times = durations(Path(args.durations).read_text())
    if args.extended_over is not None:
        write("extended.txt", {t for t, s in times.items()
                               if s > args.extended_over and t not in STANDARD})
    # An extended test is marked slow as well (tests/conftest.py): slow.txt leaves it out.
    write("slow.txt", {t for t, s in times.items() if args.over is not None and s > args.over},
          drop=listed("extended.txt")[1])


if __name__ == "__main__":
    main()
