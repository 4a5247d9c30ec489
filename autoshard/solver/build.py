"""From a traced graph and a mesh to the solver's pure-data Problem.

Three reductions keep the ILP small enough to solve in seconds for a 96-layer model:
1. *Layer dedup*: nodes of identical repeated layers (same module container, same op sequence,
   shapes and wiring) share the decisions of the first such layer; they only raise multiplicities.
2. *Follower merging* (Alpa): a view-like or unary op reading one value made in the same layer
   takes, for each strategy of its producer's group, its own cheapest strategy given that input;
   it adds no variable.
3. *Fanouts*: a value several groups read is resharded once per requirement, see problem.py.
Reshards are priced on ``lower_on`` when given: the real mesh whose axes ``mesh`` merges.
"""
from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

import autoshard.solver.rules  # noqa: F401  (registers every rule)
from autoshard.cost.comm import reshard, reshard_time
from autoshard.cost.compute import op_time
from autoshard.cost.memory import param_state_bytes, saved_activation_bytes, saved_input_bytes
from autoshard.ir import Replicate, Shard, Spec, Strategy, local_shape, spec_fits
from autoshard.lowering import (ValueRef, grad_values, input_divergence, output_requirement,
                                no_backward, value_inputs, value_ref, value_shapes)
from autoshard.mesh import Mesh
from autoshard.solver.problem import Edge, Fanout, Group, Problem
from autoshard.solver.rules.registry import OpInfo, TensorInfo, strategies_for
from autoshard.trace.export import TracedGraph, layer_of, module_path, op_info, output_infos

aten = torch.ops.aten

FOLLOWERS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.default, aten.contiguous.default, aten.clone.default, aten.alias.default,
    aten.detach.default, aten.dropout.default, aten.gelu.default, aten.silu.default,
    aten.relu.default, aten.tanh.default, aten.neg.default, aten.rsqrt.default,
    aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.type_as.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.expand.default,
}
# Elementwise ops that follow their one full-size input when the others are broadcast (a bias, a
# rotary table, a norm's scale): the small inputs become edges, the big one decides.
POINTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.where.self,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.pow.Tensor_Scalar, aten.add.Scalar,
    aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar, aten.cat.default,
}
OUTPUT = "output"
FORBIDDEN = 1e6   # seconds: a reshard the caller ruled out (the ILP never pays it)


@dataclass
class Member:
    """How one node's strategy follows its group's choice."""
    group: int
    strategies: list[Strategy]
    pick: list[int]              # strategy index of this node per group strategy


@dataclass
class Built:
    problem: Problem
    members: dict[str, Member]   # template node -> how it follows its group
    rep: dict[str, str]          # every node -> its template node

    def strategy_of(self, name: str, choice: tuple[int, ...]) -> Strategy:
        m = self.members[self.rep[name]]
        return m.strategies[m.pick[choice[m.group]]]


def placeholder_strategies(info: TensorInfo, mesh_shape: tuple[int, ...], kind: str) -> list[Strategy]:
    if kind in ("buffer", "constant") or info.ndim == 0:
        options = [tuple(Replicate() for _ in mesh_shape)]
    else:
        per_axis = [Replicate()] + [Shard(d) for d in range(info.ndim)]
        options = [s for s in itertools.product(per_axis, repeat=len(mesh_shape))
                   if spec_fits(info.shape, s, mesh_shape)]
    return [Strategy((), (s,)) for s in options]


class _Builder:
    def __init__(self, traced: TracedGraph, mesh: Mesh, memory_budget: float, optimizer: str, *,
                 in_place: frozenset[str] = frozenset(),
                 lower_on: tuple[Mesh, tuple[tuple[int, ...], ...]] | None = None) -> None:
        self.t, self.mesh, self.budget, self.optimizer = traced, mesh, memory_budget, optimizer
        self.in_place, self.lower_on = in_place, lower_on
        self.ms = mesh.shape
        self.nodes = [n for n in traced.graph.nodes
                      if n.op == "placeholder" or (n.op == "call_function"
                                                   and n.target is not operator.getitem)]
        self.by_name = {n.name: n for n in traced.graph.nodes}
        self.infos: dict[str, OpInfo] = {}
        self.shapes = value_shapes(traced.graph)
        params = self.params = {p.name for p in traced.params}
        self.grad = grad_values(traced.graph, params) if traced.training else set()
        self._follow_memo: dict[tuple, int] = {}
        self._own: dict[str, tuple[list[float], list[int]]] = {}
        self._rt_memo: dict[tuple, float] = {}
        self.ins = {n.name: value_inputs(n) for n in traced.graph.nodes if n.op != "placeholder"}
        self.layer: dict[str, tuple[str, int] | None] = {}
        for n in self.nodes:
            if n.op == "placeholder":
                ph = traced.placeholder(n.name)
                self.layer[n.name] = layer_of(ph.fqn) if ph.kind in ("param", "buffer") else None
            else:
                self.layer[n.name] = layer_of(module_path(n))

    # -- layer dedup -------------------------------------------------------------------------
    def find_reps(self) -> dict[str, str]:
        rep = {n.name: n.name for n in self.nodes}
        layers: dict[str, dict[int, list[fx.Node]]] = {}
        for n in self.nodes:
            lk = self.layer[n.name]
            if lk:
                layers.setdefault(lk[0], {}).setdefault(lk[1], []).append(n)
        for insts in layers.values():
            keys = sorted(insts)
            tmpl = insts[keys[0]]
            tsig = self._layer_sig(tmpl)
            for k in keys[1:]:
                if self._layer_sig(insts[k]) == tsig:
                    for a, b in zip(insts[k], tmpl):
                        rep[a.name] = b.name
        return rep

    def _layer_sig(self, nodes: list[fx.Node]) -> list:
        pos = {n.name: i for i, n in enumerate(nodes)}
        sig = []
        for n in nodes:
            shapes = [(t.shape, t.dtype) for t in output_infos(n)]
            if n.op == "placeholder":
                fqn = self.t.placeholder(n.name).fqn
                sig.append(("ph", _suffix(fqn), shapes))
                continue
            args = fx.node.map_aggregate(
                (n.args, n.kwargs),
                lambda a: (("in", pos[value_ref(a)[0]], value_ref(a)[1]) if value_ref(a)[0] in pos
                           else ("out", self.shapes.get(value_ref(a)))) if isinstance(a, fx.Node) else a)
            sig.append((str(n.target), repr(args), shapes))
        return sig

    # -- strategies, groups ------------------------------------------------------------------
    def node_strategies(self, n: fx.Node) -> list[Strategy]:
        if n.op == "placeholder":
            ph = self.t.placeholder(n.name)
            info = ph.info
            if info is None:
                return [Strategy((), ())]
            return placeholder_strategies(info, self.ms, ph.kind)
        info = op_info(n)
        self.infos[n.name] = info
        return strategies_for(info, self.ms)

    def node_cost(self, n: fx.Node, s: Strategy) -> float:
        if n.op == "placeholder":
            return 0.0
        return op_time(self.infos[n.name], s, self.mesh, training=self.t.training)

    def node_memory(self, n: fx.Node, s: Strategy) -> float:
        return node_memory(self.t, n, self.infos.get(n.name), s, self.ms, self.optimizer,
                           param_inputs(self.ins.get(n.name, ()), self.params))

    def build(self) -> Built:
        rep = self.find_reps()
        members: dict[str, Member] = {}
        groups_nodes: list[list[str]] = []
        self.merged: dict[str, frozenset[int]] = {}
        for n in self.nodes:
            if rep[n.name] != n.name:
                continue
            strats = self.node_strategies(n)
            merge = self._merge_plan(n, members)
            if merge is not None:
                group, positions = merge
                ins = self.ins[n.name]
                size = len(members[groups_nodes[group][0]].pick)
                pick = []
                for i in range(size):
                    srcs = {k: _spec(members[ins[k][0]], i, ins[k][1]) for k in positions}
                    pick.append(self._best_follow(n, strats, srcs))
                members[n.name] = Member(group, strats, pick)
                self.merged[n.name] = positions
                groups_nodes[group].append(n.name)
            else:
                members[n.name] = Member(len(groups_nodes), strats, list(range(len(strats))))
                groups_nodes.append([n.name])
        mult: dict[str, int] = {}
        for name, r in rep.items():
            mult[r] = mult.get(r, 0) + 1
        groups = []
        memory: dict[tuple[str, int], float] = {}     # members share strategies: price once
        for names in groups_nodes:
            root = members[names[0]]
            cost, mem = [], []
            for i in range(len(root.pick)):
                c = m_ = 0.0
                for name in names:
                    mb, node = members[name], self.by_name[name]
                    s = mb.strategies[mb.pick[i]]
                    c += self.node_cost(node, s) + self._internal_reshard(node, mb, i, members)
                    key = (name, mb.pick[i])
                    if key not in memory:
                        memory[key] = self.node_memory(node, s)
                    m_ += memory[key]
                cost.append(c)
                mem.append(m_)
            groups.append(Group(names[0], mult[names[0]], tuple(cost), tuple(mem)))
        self._out_group = len(groups)
        groups.append(Group(OUTPUT, 1, (0.0,), (0.0,)))
        edges, fanouts = self._edges(rep, members)
        problem = Problem(tuple(groups), tuple(edges), float(self.budget), fanouts=tuple(fanouts))
        return Built(problem, members, rep)

    def _merge_plan(self, n: fx.Node, members: dict[str, Member]
                    ) -> tuple[int, frozenset[int]] | None:
        """(group, input positions read from it) if ``n`` should follow a group, else None."""
        if n.op != "call_function":
            return None
        ins = self.ins[n.name]
        local = {k: members[r[0]].group for k, r in enumerate(ins)
                 if self.layer[r[0]] == self.layer[n.name] and r[0] in members
                 and self.by_name[r[0]].op != "placeholder"}
        if not local:
            return None
        if n.target in FOLLOWERS and len(ins) == 1:
            return local[0], frozenset({0})
        groups = set(local.values())
        if len(local) == len(ins) and len(groups) == 1:
            return groups.pop(), frozenset(local)
        if n.target in POINTWISE:
            sizes = [math.prod(self.shapes[r][0]) for r in ins]
            big = max(sizes)
            mains = [k for k, sz in enumerate(sizes) if sz == big]
            if len(mains) == 1 and mains[0] in local:
                g = local[mains[0]]
                return g, frozenset(k for k, gg in local.items() if gg == g)
        return None

    def _follow_cost(self, n: fx.Node, s: Strategy, srcs: dict[int, Spec], base: float) -> float:
        ins = self.ins[n.name]
        t = base
        for k, spec in srcs.items():
            shape, itemsize = self.shapes[ins[k]]
            grad = ins[k][0] in self.grad
            div = input_divergence(s, k) if grad else frozenset()
            t += self._reshard_time(spec, s.inputs[k], shape, itemsize, div, grad)
        return t

    def _best_follow(self, n: fx.Node, strats: list[Strategy], srcs: dict[int, Spec]) -> int:
        """The follower's cheapest strategy (own cost + reshards in), lowest index on ties.
        Strategies are tried by own cost, stopping once that alone exceeds the best total."""
        key = (n.name, tuple(sorted(srcs.items())))
        if key in self._follow_memo:
            return self._follow_memo[key]
        if n.name not in self._own:
            own = [self.node_cost(n, s) for s in strats]
            self._own[n.name] = (own, sorted(range(len(strats)), key=lambda j: (own[j], j)))
        own, order = self._own[n.name]
        best = (float("inf"), -1)
        for j in order:
            if own[j] > best[0]:
                break
            best = min(best, (self._follow_cost(n, strats[j], srcs, own[j]), j))
        self._follow_memo[key] = best[1]
        return best[1]

    def _reshard_time(self, src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
                      div: frozenset[int], grad: bool) -> float:
        key = (src, dst, shape, itemsize, div, grad)
        t = self._rt_memo.get(key)
        if t is None:
            mesh, ms = self.mesh, self.ms
            if self.lower_on is not None:      # price as it will run on the real mesh
                mesh, groups = self.lower_on
                ms = mesh.shape
                src, dst = expand_spec(src, groups), expand_spec(dst, groups)
                div = frozenset(a for g in div for a in groups[g])
            r = reshard(src, dst, shape, itemsize, ms, div)
            t = self._rt_memo[key] = reshard_time(r if grad else no_backward(r), mesh)
        return t

    def _internal_reshard(self, n: fx.Node, mb: Member, i: int, members: dict[str, Member]) -> float:
        positions = self.merged.get(n.name)
        if not positions:
            return 0.0
        ins = self.ins[n.name]
        s = mb.strategies[mb.pick[i]]
        srcs = {k: _spec(members[ins[k][0]], i, ins[k][1]) for k in positions}
        return self._follow_cost(n, s, srcs, 0.0)

    def _edges(self, rep: dict[str, str], members: dict[str, Member]
               ) -> tuple[list[Edge], list[Fanout]]:
        consumers: dict[ValueRef, list[tuple[str, int]]] = {}
        for node in self.t.graph.nodes:
            if node.op == "output":
                if self.t.training:
                    for k, ref in enumerate(self.ins[node.name]):
                        consumers.setdefault(ref, []).append((OUTPUT, k))
            elif node.name in rep and node.op == "call_function":
                for k, ref in enumerate(self.ins[node.name]):
                    consumers.setdefault(ref, []).append((node.name, k))
        keyed: dict[tuple, int] = {}
        for ref, cons in consumers.items():
            key_cons = []
            for c, k in cons:
                rc = rep.get(c, c)
                if c != OUTPUT and k in self.merged.get(rc, ()):
                    continue          # internal to a group: priced in the group
                key_cons.append((rc, k))
            if key_cons:
                key = (rep[ref[0]], ref[1], tuple(sorted(key_cons)))
                keyed[key] = keyed.get(key, 0) + 1
        edges: list[Edge] = []
        fanouts: list[Fanout] = []
        for (pname, o, cons), mult in keyed.items():
            pm = members[pname]
            src_specs = [pm.strategies[i].outputs[o] for i in pm.pick]
            shape, itemsize = self.shapes[(pname, o)]
            # Whether the value has a gradient is the producer's property: a template consumer
            # may read a gradient-free input in its own layer (layer 0 reads the batch) and a
            # gradient-carrying one in the others.
            grad = pname in self.grad
            reqs = [self._requirements(c, k, members, grad) for c, k in cons]
            name = f"{pname}:{o}"
            # One requirement list for every consumer: a fanout pays each requirement in use once.
            keys = list(dict.fromkeys(r for _, req in reqs for r in req))
            specs = list(dict.fromkeys(src_specs))
            cost = tuple(tuple(self._price(name, src, dst, shape, itemsize, grad) for dst in keys)
                         for src in specs)
            memory = self._copy_memory(pname, cons, specs, keys)
            out = tuple(specs.index(sp) for sp in src_specs)
            # Consumers alike (one template read by every layer) share their reshards: one entry.
            classes = list(dict.fromkeys((cgroup, tuple(keys.index(r) for r in req))
                                         for cgroup, req in reqs))
            if len(classes) == 1:
                edges.append(Edge(name, mult, pm.group, classes[0][0], out, classes[0][1], cost,
                                  memory))
            else:
                fanouts.append(Fanout(name, mult, pm.group, out, tuple(classes), cost, memory))
        return edges, fanouts

    def _copy_memory(self, pname: str, cons: tuple[tuple[str, int], ...], specs: list[Spec],
                     keys: list[tuple[Spec, frozenset[int]]]) -> tuple[tuple[float, ...], ...]:
        """[src spec][requirement] bytes of a parameter's resharded copy that a consumer keeps
        for backward (the parameter itself is in model state: node_memory leaves it out)."""
        if pname not in self.params or not self.t.training:
            return ()
        saved = {}
        for dst, _ in keys:
            saved[dst] = max([saved_input_bytes(self.infos[c], k, dst, self.ms) for c, k in cons
                              if c != OUTPUT and c in self.infos] or [0])
        memory = tuple(tuple(float(saved[dst]) if src != dst else 0.0 for dst, _ in keys)
                       for src in specs)
        return memory if any(any(row) for row in memory) else ()

    def _requirements(self, cname: str, k: int, members: dict[str, Member], grad: bool
                      ) -> tuple[int, list[tuple[Spec, frozenset[int]]]]:
        if cname == OUTPUT:
            return self._out_group, [(output_requirement(len(self.ms)), frozenset())]
        cm = members[cname]
        out = []
        for j in cm.pick:
            s = cm.strategies[j]
            out.append((s.inputs[k], input_divergence(s, k) if grad else frozenset()))
        return cm.group, out

    def _price(self, name: str, src: Spec, dst: tuple[Spec, frozenset[int]],
               shape: tuple[int, ...], itemsize: int, grad: bool) -> float:
        """Seconds to reshard value ``name`` from ``src`` to the requirement ``dst``."""
        if name.split(":")[0] in self.in_place and src != dst[0] and any(
                st.kind != "to_partial" for st in reshard(src, dst[0], shape, itemsize,
                                                          self.ms).forward):
            return FORBIDDEN       # only a row-parallel bias may become a local summand
        return self._reshard_time(src, dst[0], shape, itemsize, dst[1], grad)


def param_inputs(ins: Sequence[tuple[str, int]], params: set[str]) -> frozenset[int]:
    """Input positions that read a parameter directly."""
    return frozenset(k for k, ref in enumerate(ins) if ref[0] in params)


def node_memory(traced: TracedGraph, n: fx.Node, info: OpInfo | None, s: Strategy,
                mesh_shape: tuple[int, ...], optimizer: str,
                params_read: frozenset[int] = frozenset()) -> float:
    """Bytes one device holds for a node: a parameter's state (weights, gradient, optimizer), a
    buffer, or what an op saves for backward (training only). ``params_read``: input positions
    that read a parameter, which the op saves without a copy of its own (a resharded copy is
    charged on the edge that makes it)."""
    if n.op == "placeholder":
        ph = traced.placeholder(n.name)
        if ph.info is None or ph.kind == "input":
            return 0.0
        numel = math.prod(local_shape(ph.info.shape, s.outputs[0], mesh_shape))
        if ph.kind == "param":
            return float(param_state_bytes(numel, ph.info.dtype,
                                           optimizer=optimizer if traced.training else "none"))
        return float(numel * ph.info.dtype.itemsize)
    if not traced.training or info is None:
        return 0.0
    return float(saved_activation_bytes(info, s, mesh_shape, exclude=params_read))


def _spec(m: Member, i: int, out: int) -> Spec:
    """The spec of output ``out`` of a member when its group runs strategy ``i``."""
    return m.strategies[m.pick[i]].outputs[out]


def _suffix(fqn: str) -> str:
    lk = layer_of(fqn)
    return fqn[len(f"{lk[0]}.{lk[1]}"):] if lk else fqn


def expand_spec(spec: Spec | None, groups: tuple[tuple[int, ...], ...]) -> Spec | None:
    """A spec on a mesh whose axes merge ``groups`` of real axes, on the real mesh."""
    return None if spec is None else tuple(spec[i] for i, g in enumerate(groups) for _ in g)


def build_problem(traced: TracedGraph, mesh: Mesh, *, memory_budget: float | None = None,
                  optimizer: str = "adam", in_place: frozenset[str] = frozenset(),
                  lower_on: tuple[Mesh, tuple[tuple[int, ...], ...]] | None = None) -> Built:
    """``in_place``: parameters every op must read in their stored layout (a hand-written plan's
    weights are used where they lie, never resharded on the way in). ``lower_on``: ``mesh``
    merges axes of this real mesh (see planner.py); reshards are priced as they run there."""
    budget = mesh.cluster.memory_bytes if memory_budget is None else memory_budget
    return _Builder(traced, mesh, budget, optimizer, in_place=in_place, lower_on=lower_on).build()
