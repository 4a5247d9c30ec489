"""From a traced graph and a mesh to the solver's pure-data Problem.

Three reductions keep the ILP small enough to solve in seconds for a 96-layer model:
1. *Identical layers* (trace/layers.py): the nodes of a layer identical to an earlier one take
   the decisions of that earlier layer (its *template*); they only raise multiplicities.
2. *Follower merging* (Alpa): a view-like or unary op reading one value made in the same layer
   (its record says it ``follows``) takes, for each strategy of its producer's decision, its own
   cheapest strategy given that input; it adds no variable.
3. *Fanouts*: a value several decisions read is resharded once per requirement, see problem.py.

Every coefficient is a price from cost/price.py, the function the Plan's figures are summed from.
"""
from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch.fx as fx

import autoshard.ops  # noqa: F401  (registers every op)
from autoshard.cost.price import Pricer
from autoshard.cost.reshards import input_divergence, output_requirement
from autoshard.cost.comm import reshard
from autoshard.cost.memory import device_budget, host_budget
from autoshard.cost.state import HOST_MODES, SCATTERS
from autoshard.ir import (OffloadLevel, Replicate, Shard, Spec, StateMode, Strategy, TensorInfo,
                          ZIGZAG, spec_fits)
from autoshard.mesh import AxisMerge, Mesh
from autoshard.ops.attention import CP_KERNELS, SDPA
from autoshard.ops.registry import strategies_for
from autoshard.options import CONTEXT_PARALLEL_TOKENS, PlanOptions
from autoshard.solver.follow import Followers
from autoshard.solver.problem import FORBIDDEN, Decision, Edge, Fanout, Problem
from autoshard.trace.aliases import pinned_reads, written_placeholders
from autoshard.trace.export import TracedGraph
from autoshard.trace.graph import ValueRef, value_inputs

OUTPUT = "output"
# Seconds: the price of resharding a pinned parameter of a hand-written plan on the way into an
# op (``build_problem``'s ``in_place``). A preference, not a rule: where the pins leave no
# other way (a tied table pinned one way and read another), the plan pays it and runs the
# reshard, as any plan may; a reshard no plan may hold is FORBIDDEN (solver/problem.py).
AVOIDED = 1e6


class BuildTimeout(Exception):
    """Building the problem ran past the caller's deadline (``build_problem``), or left too
    little of the time to solve it: the problem is too large to solve in the time given."""


@dataclass
class Member:
    """How one node's strategy follows its decision's choice."""
    decision: int
    strategies: list[Strategy]
    index: list[int]             # this node's strategy index for each strategy of its decision


@dataclass
class Built:
    problem: Problem
    members: dict[str, Member]   # template node -> how it follows its decision
    template: dict[str, str]     # every node -> the node of its layer's template it copies
    tied_to: dict[str, str]      # a tied weight's later graph input -> its first

    def strategy_of(self, name: str, choice: tuple[int, ...]) -> Strategy:
        m = self.members[self.template[name]]
        return m.strategies[m.index[choice[m.decision]]]


def placeholder_strategies(info: TensorInfo, mesh_shape: tuple[int, ...],
                           kind: str, written: bool = False) -> list[Strategy]:
    """The layouts a graph input may be stored in: a parameter's, and a buffer some op
    ``written`` into (a batch norm's running statistics, which a rank normalising its own
    channels updates for them), any; another buffer, a constant or a scalar, whole."""
    if (kind in ("buffer", "constant") and not written) or info.ndim == 0:
        options = [tuple(Replicate() for _ in mesh_shape)]
    else:
        # and strided on a dim the model splits into groups (trace/fused.py)
        per_axis = [Replicate()] + [Shard(d) for d in range(info.ndim)] + [
            Shard(d, g) for d, g in info.groups]
        options = [s for s in itertools.product(per_axis, repeat=len(mesh_shape))
                   if spec_fits(info.shape, s, mesh_shape)]
    return [Strategy((), (s,)) for s in options]


class _Builder:
    def __init__(self, traced: TracedGraph, pricer: Pricer, memory_budget: float, *,
                 in_place: frozenset[str] = frozenset(), deadline: float | None = None,
                 host_budget: float | None = None) -> None:
        self.traced, self.pricer, self.budget, self.in_place = traced, pricer, memory_budget, in_place
        self.host_budget = host_budget
        self.deadline = deadline
        self.mesh_shape = pricer.mesh.shape
        self.nodes = [n for n in traced.graph.nodes
                      if n.op == "placeholder" or (n.op == "call_function"
                                                   and n.target is not operator.getitem)]
        self.by_name = {n.name: n for n in traced.graph.nodes}
        self.shapes = pricer.shapes
        self.ins = {n.name: value_inputs(n) for n in traced.graph.nodes if n.op != "placeholder"}
        self.followers = Followers(pricer, self.ins, traced.layer_of_node, self.by_name)
        self.layer = traced.layer_of_node
        self.context_parallel = _context_parallel(traced, pricer)

    def templates(self) -> dict[str, str]:
        """Every node -> itself, or the node of an identical earlier layer it copies."""
        template = {n.name: n.name for n in self.nodes}
        by_name = {layer.name: layer for layer in self.traced.layers}
        for layer in self.traced.layers:
            if layer.same_as != layer.name:
                template.update(zip(layer.nodes, by_name[layer.same_as].nodes))
        return template

    # -- strategies, decisions ---------------------------------------------------------------
    def node_strategies(self, n: fx.Node) -> list[Strategy]:
        if n.op == "placeholder":
            ph = self.traced.placeholder(n.name)
            if ph.info is None:
                return [Strategy((), ())]
            out = placeholder_strategies(ph.info, self.mesh_shape, ph.kind,
                                         n.name in self.written)
            if ph.kind != "param":
                return out
            # One strategy per (layout, state mode, state axes): the mode rides in ``kernel``
            # (cost/state.py).
            return [Strategy((), st.outputs, mode, state_axes=axes) for st in out
                    for mode, axes in self.pricer.param_states(n.name, st.outputs[0])]
        out = strategies_for(self.pricer.info(n.name), self.mesh_shape)
        if self.context_parallel:
            only = CP_KERNELS.get(self.pricer.options.context_parallel)
            return out if only is None else [
                st for st in out if st.kernel not in CP_KERNELS.values() or st.kernel == only]
        return [st for st in out if not any(
            isinstance(p, Shard) and p.groups == ZIGZAG
            for spec in (*st.inputs, *st.outputs) if spec is not None for p in spec)]

    def build(self) -> Built:
        template = self.templates()
        # Reads an in-place write pins (trace/aliases.py), by template node: a layer's copies
        # read as its template does.
        self.pinned = {(template.get(c, c), k) for c, k in pinned_reads(self.traced.graph)}
        self.written = written_placeholders(self.traced.graph)
        members: dict[str, Member] = {}
        decision_nodes: list[list[str]] = []
        self.merged: dict[str, frozenset[int]] = {}
        for n in self.nodes:
            if template[n.name] != n.name:
                continue
            strats = self.node_strategies(n)
            tied = self.pricer.tied_to.get(n.name)
            merge = None if tied is not None else self.followers.follow(
                n, strats, members, decision_nodes, self.pinned)
            if tied is not None:
                # A tied weight is stored once: every graph input it is lifted as takes the
                # first one's layout (its reads may still reshard it).
                first = members[tied]
                members[n.name] = Member(first.decision, strats, list(first.index))
                decision_nodes[first.decision].append(n.name)
            elif merge is not None:
                decision, positions, index = merge
                members[n.name] = Member(decision, strats, index)
                self.merged[n.name] = positions
                decision_nodes[decision].append(n.name)
            else:
                members[n.name] = Member(len(decision_nodes), strats, list(range(len(strats))))
                decision_nodes.append([n.name])
        multiplicity: dict[str, int] = {}
        for tmpl in template.values():
            multiplicity[tmpl] = multiplicity.get(tmpl, 0) + 1
        decisions = []
        memory: dict[tuple[str, int], float] = {}     # members share strategies: price once
        for names in decision_nodes:
            root = members[names[0]]
            cost, mem, bwd, host = [], [], [], []
            for i in range(len(root.index)):
                c = m_ = b = h = 0.0
                seen: set[tuple] = set()     # a reshard two followers need runs once
                for name in names:
                    mb = members[name]
                    s = mb.strategies[mb.index[i]]
                    c += self.pricer.compute(name, s) + self._internal_reshard(name, mb, i, members,
                                                                                seen)
                    c += self.pricer.op_comm_seconds(name, s)
                    if self.by_name[name].op == "placeholder":
                        c += self.pricer.optimizer_comm_seconds(name, s)
                        h += self.pricer.state_bytes(name, s).host
                    b += self.pricer.backward(name, s)
                    key = (name, mb.index[i])
                    if key not in memory:
                        memory[key] = self.pricer.memory(name, s)
                    m_ += memory[key]
                cost.append(c)
                mem.append(m_)
                bwd.append(b)
                host.append(h)
            decisions.append(Decision(names[0], multiplicity[names[0]], tuple(cost), tuple(mem),
                                      tuple(bwd) if any(bwd) else (),
                                      tuple(host) if any(host) else ()))
        self._out_decision = len(decisions)
        decisions.append(Decision(OUTPUT, 1, (0.0,), (0.0,)))
        # The values a follower reads from its own decision (resharded inside it), and by whom.
        self._internal: dict[ValueRef, list[tuple[str, int]]] = {}
        for names in decision_nodes:
            for name in names:
                for k in self.merged.get(name, ()):
                    self._internal.setdefault(self.ins[name][k], []).append((name, k))
        edges, fanouts = self._edges(template, members)
        problem = Problem(tuple(decisions), tuple(edges), float(self.budget),
                          fanouts=tuple(fanouts), host_budget=self.host_budget)
        return Built(problem, members, template, self.pricer.tied_to)

    def _internal_reshard(self, name: str, mb: Member, i: int, members: dict[str, Member],
                          seen: set[tuple]) -> float:
        """The reshards into follower ``name`` under its decision's strategy ``i``, but those in
        ``seen``: followers of one decision that read one value in one layout (the slices of a
        fused QKV output) share its reshard, as the program runs it once (codegen/rewrite.py)."""
        positions = self.merged.get(name)
        if not positions:
            return 0.0
        ins = self.ins[name]
        s = mb.strategies[mb.index[i]]
        t = 0.0
        for k in positions:
            src = _spec(members[ins[k][0]], i, ins[k][1])
            key = (ins[k], src, s.inputs[k], input_divergence(s, k))
            if key in seen:
                continue
            seen.add(key)
            t += self.pricer.reshard_seconds(ins[k], src, s.inputs[k], key[3])
            if self.pricer.reshards_again(name):  # the reshard runs again in recompute
                t += self.pricer.forward_seconds(ins[k], src, s.inputs[k])
        return t

    def _edges(self, template: dict[str, str], members: dict[str, Member]
               ) -> tuple[list[Edge], list[Fanout]]:
        edges: list[Edge] = []
        fanouts: list[Fanout] = []
        keyed = _keyed_reads(self.traced, self.ins, self.merged, template)
        for (pname, o, cons), multiplicity in keyed.items():
            pm = members[pname]
            # A parameter's source is its layout, its state mode and, where its gradient is
            # reduce-scattered (zero2, offload), the axes it is over; any other value's, its
            # layout.
            param = pname in self.pricer.params
            grad = self.pricer.has_grad((pname, o))
            # And the layouts its decision's followers reshard it to (``made``): a consumer
            # outside that needs one of them shares that reshard, as the program runs each
            # (value, requirement) once (cost/reshards.py): it costs the edge nothing.
            inside = self._internal.get((pname, o))
            src_specs = [(pm.strategies[i].outputs[o], *_state_of(pm.strategies[i], param),
                          _made(inside, p, members, grad) if inside else frozenset())
                         for p, i in enumerate(pm.index)]
            # Whether the value has a gradient is the producer's property: a template consumer
            # may read a gradient-free input in its own layer (layer 0 reads the batch) and a
            # gradient-carrying one in the others.
            reqs = [self._requirements(c, k, members, grad) for c, k in cons]
            # One requirement list for every consumer: a fanout pays each requirement in use
            # once (a pinned read's requirement is a key of its own, priced as forbidden unless
            # it reads the value as it lies).
            keys = list(dict.fromkeys(r for _, req in reqs for r in req))
            specs = list(dict.fromkeys(src_specs))
            value = (pname, o)
            prices = [[self._price(value, src, dst, mode, axes) for dst in keys]
                      for src, mode, axes, _ in specs]
            if all(c != OUTPUT and self.pricer.reshards_again(c) for c, _ in cons):
                # Read only inside fully checkpointed layers: it runs again in recompute.
                prices = [[(t + self.pricer.forward_seconds(value, src, dst[0]), sync)
                           for (t, sync), dst in zip(row, keys)]
                          for row, (src, _, _, _) in zip(prices, specs)]
            if param and any(mode == StateMode.OFFLOAD_PARAMS for _, mode, _, _ in specs):
                # A parameter kept on the host: each use copies it to the device (again where
                # it is read only inside checkpointed layers) and its gradient back.
                again = all(c != OUTPUT and self.pricer.recomputed(c) for c, _ in cons)
                prices = [[(t + self.pricer.host_seconds(value, src, dst[0], dst[1], mode, again),
                            sync) for (t, sync), dst in zip(row, keys)]
                          for row, (src, mode, _, _) in zip(prices, specs)]
            prices = [[(0.0, 0.0) if not dst[2] and dst[:2] in made else p
                       for p, dst in zip(row, keys)]
                      for row, (_, _, _, made) in zip(prices, specs)]
            cost = tuple(tuple(p[0] for p in row) for row in prices)
            sync = tuple(tuple(p[1] for p in row) for row in prices)
            memory: tuple = ()
            if all(c != OUTPUT and self.pricer.policy(c) == "selective" for c, _ in cons):
                # Read only inside selectively checkpointed layers: a collective's output is
                # stored.
                memory = tuple(tuple(self.pricer.stored_reshard_bytes(value, src, dst[0],
                                                                      cons[0][0])
                                     for dst in keys) for src, _, _, _ in specs)
                memory = memory if any(any(row) for row in memory) else ()
            out = tuple(specs.index(sp) for sp in src_specs)
            # Consumers alike (one template read by every layer) share their reshards: one entry.
            classes = list(dict.fromkeys((cdec, tuple(keys.index(r) for r in req))
                                         for cdec, req in reqs))
            self._add(edges, fanouts, f"{pname}:{o}", multiplicity, pm.decision, out, classes,
                      cost, memory, sync if any(any(row) for row in sync) else ())
        self._saved_items(template, members, edges, fanouts)
        return edges, fanouts

    @staticmethod
    def _add(edges: list[Edge], fanouts: list[Fanout], name: str, multiplicity: int,
             producer: int, out: tuple[int, ...], classes: list, cost: tuple, memory: tuple,
             sync: tuple = ()) -> None:
        if len(classes) == 1:
            edges.append(Edge(name, multiplicity, producer, classes[0][0], out, classes[0][1],
                              cost, memory, sync))
        else:
            fanouts.append(Fanout(name, multiplicity, producer, out, tuple(classes), cost, memory,
                                  sync))

    def _saved_items(self, template: dict[str, str], members: dict[str, Member],
                     edges: list[Edge], fanouts: list[Fanout]) -> None:
        """Memory-only items: a value its consumers save for backward is kept once per layout
        they read it in (Pricer.saved_copy_bytes), whichever decision (or follower merged into
        one) reads it."""
        keyed: dict[tuple, int] = {}
        for ref, cons in self.pricer.saved_inputs().items():
            key = (template[ref[0]], ref[1], tuple(sorted({(template[c], k) for c, k in cons})))
            keyed[key] = keyed.get(key, 0) + 1
        for (pname, o, cons), multiplicity in keyed.items():
            pm = members[pname]
            # A parameter's source is its layout and state mode (one kept on the host is read
            # from its copy on the device, which its savers keep); any other value's, its layout.
            param = pname in self.pricer.params
            src_specs = [(pm.strategies[i].outputs[o], pm.strategies[i].kernel if param else None)
                         for i in pm.index]
            reqs = [(members[c].decision, [members[c].strategies[j].inputs[k]
                                           for j in members[c].index]) for c, k in cons]
            keys = list(dict.fromkeys(r for _, req in reqs for r in req))
            specs = list(dict.fromkeys(src_specs))
            value = (pname, o)
            real = self.pricer.saved_inputs()[value] if value in self.pricer.saved_inputs() \
                else cons
            memory = tuple(tuple(self.pricer.saved_copy_bytes(value, src, dst, mode)
                                 * self.pricer.copy_weight(value, real, src, dst)
                                 for dst in keys) for src, mode in specs)
            if not any(any(row) for row in memory):
                continue
            classes = list(dict.fromkeys((cdec, tuple(keys.index(r) for r in req))
                                         for cdec, req in reqs))
            zero = tuple((0.0,) * len(keys) for _ in specs)
            self._add(edges, fanouts, f"{pname}:{o}:saved", multiplicity, pm.decision,
                      tuple(specs.index(sp) for sp in src_specs), classes, zero, memory)

    def _requirements(self, cname: str, k: int, members: dict[str, Member], grad: bool
                      ) -> tuple[int, list[tuple[Spec, frozenset[int], bool]]]:
        if cname == OUTPUT:
            return self._out_decision, [(output_requirement(len(self.mesh_shape)), frozenset(),
                                         False)]
        cm = members[cname]
        pinned = (cname, k) in self.pinned
        out = []
        for j in cm.index:
            s = cm.strategies[j]
            out.append((s.inputs[k], input_divergence(s, k) if grad else frozenset(), pinned))
        return cm.decision, out

    def _price(self, value: ValueRef, src: Spec, dst: tuple[Spec, frozenset[int], bool],
               mode: StateMode | None = None, axes: tuple[int, ...] | None = None
               ) -> tuple[float, float]:
        """(Blocking, gradient-sync) seconds to reshard ``value`` from ``src`` to ``dst``
        (its layout, divergent axes, and whether the read is pinned: trace/aliases.py;
        ``mode``, ``axes``: a parameter's state mode and state axes)."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise BuildTimeout()
        if dst[2] and src != dst[0]:
            return FORBIDDEN, 0.0  # an in-place write must land in the storage later reads see
        if value[0] in self.in_place and src != dst[0] and any(
                st.kind != "to_partial" for st in reshard(src, dst[0], self.shapes[value][0],
                                                          self.shapes[value][1],
                                                          self.mesh_shape).forward):
            return AVOIDED, 0.0    # only a row-parallel bias may become a local summand
        return self.pricer.reshard_cost(value, src, dst[0], dst[1], mode, axes)


def _keyed_reads(traced: TracedGraph, ins: dict[str, list], merged: dict[str, frozenset[int]],
                 template: dict[str, str]) -> dict[tuple, int]:
    """The reads between decisions, (producer, output, consumers) -> how many alike (one
    template read by every layer): the consumers read the value outside its decision (the
    reads of a decision's own followers are priced in the decision)."""
    consumers: dict[ValueRef, list[tuple[str, int]]] = {}
    for node in traced.graph.nodes:
        if node.op == "output":
            if traced.training:
                for k, ref in enumerate(ins[node.name]):
                    consumers.setdefault(ref, []).append((OUTPUT, k))
        elif node.name in template and node.op == "call_function":
            for k, ref in enumerate(ins[node.name]):
                consumers.setdefault(ref, []).append((node.name, k))
    keyed: dict[tuple, int] = {}
    for ref, cons in consumers.items():
        key_cons = [(template.get(c, c), k) for c, k in cons
                    if c == OUTPUT or k not in merged.get(template.get(c, c), ())]
        if key_cons:
            key = (template[ref[0]], ref[1], tuple(sorted(key_cons)))
            keyed[key] = keyed.get(key, 0) + 1
    return keyed


def _made(reads: Iterable[tuple[str, int]], p: int, members: dict[str, Member], grad: bool
          ) -> frozenset[tuple[Spec, frozenset[int]]]:
    """The (layout, divergent axes) the followers ``reads`` of a value's decision reshard it to
    under the decision's strategy ``p``: requirements as ``_Builder._requirements`` keys
    them."""
    out = set()
    for name, k in reads:
        m = members[name]
        s = m.strategies[m.index[p]]
        out.add((s.inputs[k], input_divergence(s, k) if grad else frozenset()))
    return frozenset(out)


def _state_of(s: Strategy, param: bool) -> tuple[StateMode | None, tuple[int, ...] | None]:
    """What of a producer's strategy, beside its layout, prices its reshards: a parameter's
    state mode, and its state axes where its bucket reduce-scatters over them."""
    if not param:
        return None, None
    return s.kernel, s.state_axes if s.kernel in SCATTERS else None


def _spec(m: Member, i: int, out: int) -> Spec:
    """The spec of output ``out`` of a member when its decision runs strategy ``i``."""
    return m.strategies[m.index[i]].outputs[out]


def _context_parallel(traced: TracedGraph, pricer: Pricer) -> bool:
    """Whether the sequence's zigzag layouts are offered (PlanOptions.context_parallel)."""
    choice = pricer.options.context_parallel
    if choice != "auto":
        return choice != "off"
    keys = [pricer.info(n.name).inputs[1].shape[-2] for n in traced.graph.nodes
            if n.op == "call_function" and n.target is SDPA]
    return max(keys, default=0) >= CONTEXT_PARALLEL_TOKENS


def build_problem(traced: TracedGraph, mesh: Mesh, options: PlanOptions = PlanOptions(), *,
                  in_place: frozenset[str] = frozenset(), merge: AxisMerge | None = None,
                  recompute: Mapping[str, str] | frozenset[str] = frozenset(),
                  offload: OffloadLevel = OffloadLevel.NONE, deadline: float | None = None
                  ) -> Built:
    """``in_place``: parameters every op must read in their stored layout (a hand-written plan's
    weights are used where they lie, never resharded on the way in). ``merge``: ``mesh`` merges
    axes of a real mesh (see planner.py); reshards are priced as they run there. ``recompute``:
    layer -> checkpointing policy, or the layers fully checkpointed (cost/price.py); ``offload``: offer optimizer
    offload as a state mode ("optimizer"), and parameter offload too ("parameters") (cost/state.py);
    the host memory they fill is bounded by the cluster's ``host_memory_bytes``. ``deadline``
    (``time.perf_counter()`` seconds): raise :class:`BuildTimeout` once pricing runs past it."""
    budget = device_budget(mesh.cluster, options.memory_budget)
    pricer = Pricer(traced, mesh, options, merge=merge, recompute=recompute, offload=offload)
    host = host_budget(mesh.cluster) if any(m in HOST_MODES for m in pricer.modes) else None
    return _Builder(traced, pricer, budget, in_place=in_place, deadline=deadline,
                    host_budget=host).build()
