"""The strategy a follower op takes for each strategy of the decision it follows
(docs/design.md, "The ILP"): a view or unary op whose record says it follows its producer adds
no variable; for each layout of its inputs it runs its cheapest strategy, own cost plus the
reshards into it, searched from the strategy that reads its inputs as they lie."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch.fx as fx

from autoshard.cost.price import Pricer
from autoshard.cost.reshards import input_divergence
from autoshard.ir import Spec, Strategy
from autoshard.ops.registry import INPUT, LARGEST, record_of

if TYPE_CHECKING:
    from autoshard.solver.build import Member


class Followers:
    """Which decision each follower follows, and its cheapest strategy per layout of its
    inputs, memoised over one problem's build (``ins``: each node's value inputs; ``layer``:
    each node's layer)."""

    def __init__(self, pricer: Pricer, ins: dict[str, list], layer: dict[str, str],
                 by_name: dict[str, fx.Node]) -> None:
        self.pricer, self.ins, self.layer, self.by_name = pricer, ins, layer, by_name
        self._memo: dict[tuple, int] = {}
        self._own: dict[str, tuple[list[float], list[int]]] = {}
        self._as_is: dict[tuple[str, tuple[int, ...]], dict[tuple, list[int]]] = {}

    def merge_plan(self, n: fx.Node, members: dict[str, Member]
                   ) -> tuple[int, frozenset[int]] | None:
        """(decision, input positions read from it) if ``n`` should follow a decision, else None."""
        if n.op != "call_function":
            return None
        ins = self.ins[n.name]
        here = self.layer.get(n.name)
        local = {k: members[r[0]].decision for k, r in enumerate(ins)
                 if self.layer.get(r[0]) == here and r[0] in members
                 and self.by_name[r[0]].op != "placeholder"}
        if not local:
            return None
        follows = record_of(n.target).follows
        if follows == INPUT and len(ins) == 1:
            return local[0], frozenset({0})
        decisions = set(local.values())
        if len(local) == len(ins) and len(decisions) == 1:
            return decisions.pop(), frozenset(local)
        if follows == LARGEST:
            sizes = [math.prod(self.pricer.shapes[r][0]) for r in ins]
            big = max(sizes)
            mains = [k for k, sz in enumerate(sizes) if sz == big]
            if len(mains) == 1 and mains[0] in local:
                d = local[mains[0]]
                return d, frozenset(k for k, dd in local.items() if dd == d)
        return None

    def follow(self, n: fx.Node, strats: list[Strategy], members: dict[str, Member],
               decision_nodes: list[list[str]], pinned: set[tuple[str, int]]
               ) -> tuple[int, frozenset[int], list[int]] | None:
        """(decision, positions read from it, strategy per decision index) where ``n`` follows
        a decision; None where it does not, or where its ``pinned`` reads (trace/aliases.py)
        find no strategy reading them as they lie."""
        merge = self.merge_plan(n, members)
        if merge is None:
            return None
        decision, positions = merge
        pins = frozenset(k for k in positions if (n.name, k) in pinned)
        ins = self.ins[n.name]
        index = []
        for i in range(len(members[decision_nodes[decision][0]].index)):
            srcs = {}
            for k in positions:
                m = members[ins[k][0]]
                srcs[k] = m.strategies[m.index[i]].outputs[ins[k][1]]
            j = self.best(n, strats, srcs, pins)
            if j < 0:
                return None
            index.append(j)
        return decision, positions, index

    def _cost(self, name: str, s: Strategy, srcs: dict[int, Spec], base: float) -> float:
        ins = self.ins[name]
        t = base
        for k, spec in srcs.items():
            t += self.pricer.reshard_seconds(ins[k], spec, s.inputs[k], input_divergence(s, k))
        return t

    def best(self, n: fx.Node, strats: list[Strategy], srcs: dict[int, Spec],
             pinned: frozenset[int] = frozenset()) -> int:
        """The follower's cheapest strategy (own cost + reshards in), lowest index on ties.
        Strategies are tried by own cost, stopping once that alone exceeds the best total.
        ``pinned``: positions it must read as they lie (trace/aliases.py); -1 where no strategy
        does."""
        key = (n.name, tuple(sorted(srcs.items())))
        if pinned:
            as_is = self._reading_as_is(n.name, strats, {k: srcs[k] for k in pinned})
            return min(as_is, default=-1,
                       key=lambda j: (self._cost(n.name, strats[j], srcs,
                                                 self.pricer.compute(n.name, strats[j])
                                                 + self.pricer.op_comm_seconds(n.name, strats[j])),
                                      j))
        if key in self._memo:
            return self._memo[key]
        if n.name not in self._own:
            own = [self.pricer.compute(n.name, s) + self.pricer.op_comm_seconds(n.name, s)
                   for s in strats]
            self._own[n.name] = (own, sorted(range(len(strats)), key=lambda j: (own[j], j)))
        own, order = self._own[n.name]
        best = (float("inf"), -1)
        # A strategy reading every source as it is laid out moves (nearly) nothing: priced
        # first, it bounds the rest, which only a lower own cost (or, tied, index) could beat.
        for j in self._reading_as_is(n.name, strats, srcs):
            best = min(best, (self._cost(n.name, strats[j], srcs, own[j]), j))
        ins = self.ins[n.name]
        for j in order:
            if (own[j], j) >= best:
                break
            floor = own[j] + sum(self.pricer.reshard_floor(ins[k], spec, strats[j].inputs[k])
                                 for k, spec in srcs.items())
            if (floor, j) >= best:
                continue
            best = min(best, (self._cost(n.name, strats[j], srcs, own[j]), j))
        self._memo[key] = best[1]
        return best[1]

    def _reading_as_is(self, name: str, strats: list[Strategy], srcs: dict[int, Spec]
                       ) -> list[int]:
        """The strategies of follower ``name`` whose inputs at ``srcs``' positions are
        ``srcs``' specs, by input positions then specs (built once per node and positions)."""
        positions = tuple(sorted(srcs))
        index = self._as_is.get((name, positions))
        if index is None:
            index = {}
            for j, s in enumerate(strats):
                index.setdefault(tuple(s.inputs[k] for k in positions), []).append(j)
            self._as_is[(name, positions)] = index
        return index.get(tuple(srcs[k] for k in positions), [])
