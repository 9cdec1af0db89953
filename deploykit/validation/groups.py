"""The groups of nodes auto-fix tries to pin together when no single node is to blame.

fp16 error that no single node causes has two usual shapes. A path of large values -- a
residual stream, a sum over many tokens -- where each rounding costs a little (fp16's spacing
grows with the value) and the roundings add up; and a chain of reduced-precision nodes between
fp32 nodes, where values are rounded on the way in, at every node and on the way out. Often both
at once: once a residual stream is fp32, the embedding that feeds it and the head that reads it
are short chains between fp32 nodes, and their rounding is what remains. So the candidates are:

* **the high-magnitude path**: the reduced-precision nodes whose fp32 values are largest, at
  halving thresholds below the largest, once with the cheap nodes only (elementwise, data
  movement: no matrix work) and once with all;
* **the chains**: the connected sets of reduced-precision nodes, bounded by fp32 nodes (or the
  graph's inputs and outputs), of the graph as it is and of the graph with each path pinned;
* each path with the chains it leaves, and the chains together, added cheapest first.

Each group costs the multiply-adds of its nodes (:mod:`deploykit.validation.cost`); the
candidates come cheapest first, none above the caller's budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from deploykit.passes.precision import LOW_TYPES, is_low, source_name
from deploykit.validation.cost import is_matrix, multiply_adds

PATH = "high-magnitude path"
CHAIN = "chains between fp32 nodes"
BOTH = "high-magnitude path and chains"
#: Thresholds of the high-magnitude path: the largest value, then halved this many times less one.
PATH_LEVELS = 8


@dataclasses.dataclass
class Group:
    """Nodes to pin together: which, why (the group's and each node's), and their multiply-adds."""

    kind: str
    why: str
    nodes: dict[str, str]  # name -> why this node
    ops: list[str]
    cost: int

    def summary(self) -> dict:
        return {"kind": self.kind, "why": self.why, "nodes": list(self.nodes), "multiply_adds": self.cost}

    def joined(self, chain: Group) -> Group:
        """This group and a chain it does not overlap; each node keeps its reason."""
        kind = CHAIN if self.kind == CHAIN else BOTH
        return Group(kind, f"{self.why}; {chain.why}", {**self.nodes, **chain.nodes}, self.ops + chain.ops,
                     self.cost + chain.cost)


def candidate_groups(graph: ir.Graph, retype: Callable[[list[str]], ir.Graph], magnitudes: dict[str, float],
                     shapes: dict[str, tuple], pinnable: set[str], precision: str, budget: float) -> list[Group]:
    """Groups of the reduced-precision nodes of ``graph`` (a typed graph) to try, cheapest first.

    ``retype(names)``: ``graph`` typed again with those nodes pinned too; ``magnitudes``: the
    largest |value| of each tensor of the fp32 graph on the failing inputs; ``shapes``: its
    tensor shapes; ``budget``: the most multiply-adds a group may hold.
    """
    paths = [g for g in _path_groups(_low(graph, pinnable), magnitudes, shapes, precision) if g.cost <= budget]
    groups: dict[frozenset, Group] = {}
    for base in [None, *paths]:
        typed = graph if base is None else retype(list(base.nodes))
        chains = sorted(_chains(_low(typed, pinnable), pinnable, shapes, precision), key=lambda g: g.cost)
        for group in _with_chains(base, chains, budget):
            groups.setdefault(frozenset(group.nodes), group)
    return sorted(groups.values(), key=lambda g: (g.cost, len(g.nodes)))


def _low(graph: ir.Graph, pinnable: set[str]) -> list[ir.Node]:
    return [node for node in graph if node.name in pinnable and any(is_low(v) for v in node.outputs)]


def _with_chains(base: Group | None, chains: list[Group], budget: float) -> list[Group]:
    """``base``, then it with the chains added one by one, cheapest first, within ``budget``."""
    groups, current = ([base] if base else []), base
    for chain in chains:
        current = chain if current is None else current.joined(chain)
        if current.cost > budget:
            break
        groups.append(current)
    return groups


def _magnitude(node: ir.Node, magnitudes: dict[str, float]) -> float:
    return max((magnitudes.get(source_name(v.name), 0.0) for v in node.outputs), default=0.0)


def _path_groups(low: list[ir.Node], magnitudes: dict, shapes: dict, precision: str) -> list[Group]:
    size = {node.name: _magnitude(node, magnitudes) for node in low}
    ranked = sorted((n for n in low if size[n.name] > 0), key=lambda n: size[n.name], reverse=True)
    if not ranked:
        return []
    groups = []
    for cheap_only in (True, False):
        pool = [node for node in ranked if not (cheap_only and is_matrix(node))]
        for level in range(PATH_LEVELS):
            threshold = size[ranked[0].name] / 2**level
            members = [node for node in pool if size[node.name] >= threshold]
            if not members:
                continue
            scope = "cheap nodes (no matrix work)" if cheap_only else "nodes"
            why = f"the {len(members)} {precision} {scope} with fp32 values of {threshold:.3g} or more"
            reasons = {n.name: f"{PATH}: fp32 values up to {size[n.name]:.3g}, where {precision} steps by "
                               f"{_spacing(size[n.name], precision):.3g}" for n in members}
            groups.append(_group(PATH, why, members, reasons, shapes))
    return groups


def _spacing(value: float, precision: str) -> float:
    """The distance between neighbouring ``precision`` numbers at ``value``."""
    kind = LOW_TYPES[precision].numpy()
    return float(np.spacing(np.array(value, dtype=kind)).astype(np.float64))


def _chains(low: list[ir.Node], pinnable: set[str], shapes: dict, precision: str) -> list[Group]:
    members = set(low)
    groups, seen = [], set()
    for start in low:
        if start in seen:
            continue
        chain = _connected(start, members)
        seen |= chain
        ordered = [node for node in low if node in chain]  # graph order
        entries, exits = _around(ordered, pinnable)
        why = f"a chain of {len(ordered)} {precision} node(s) between {_names(entries)} and {_names(exits)}"
        groups.append(_group(CHAIN, why, ordered, dict.fromkeys((n.name for n in ordered), f"on {why}"), shapes))
    return groups


def _connected(start: ir.Node, members: set[ir.Node]) -> set[ir.Node]:
    """The nodes of ``members`` reachable from ``start`` through values passed between members."""
    chain, todo = {start}, [start]
    while todo:
        node = todo.pop()
        neighbours = [v.producer() for v in node.inputs if v is not None]
        neighbours += [reader for v in node.outputs for reader in v.consumers()]
        for other in neighbours:
            if other in members and other not in chain:
                chain.add(other)
                todo.append(other)
    return chain


def _around(chain: list[ir.Node], pinnable: set[str]) -> tuple[list[str], list[str]]:
    """Names of what feeds the chain and what reads it, looking through boundary Casts."""
    inside = set(chain)
    entries, exits = [], []
    for node in chain:
        for value in node.inputs:
            entries += _sources(value, inside, pinnable)
        for value in node.outputs:
            exits += _readers(value, inside, pinnable)
    return list(dict.fromkeys(entries)), list(dict.fromkeys(exits))


def _sources(value: ir.Value | None, inside: set, pinnable: set[str]) -> list[str]:
    if value is None or value.const_value is not None and value.producer() is None:
        return []
    producer = value.producer()
    if producer is None:
        return [f"input {value.name}"] if value.is_graph_input() else []
    if producer in inside:
        return []
    if producer.name not in pinnable:  # a boundary Cast
        return _sources(producer.inputs[0], inside, pinnable)
    return [producer.name]


def _readers(value: ir.Value, inside: set, pinnable: set[str]) -> list[str]:
    names = [f"output {source_name(value.name)}"] if value.is_graph_output() else []
    for reader in value.consumers():
        if reader in inside:
            continue
        if reader.name not in pinnable:
            names += [n for out in reader.outputs for n in _readers(out, inside, pinnable)]
        else:
            names.append(reader.name)
    return names


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:2])
    return f"{shown} and {len(names) - 2} more" if len(names) > 2 else shown or "nothing"


def _group(kind: str, why: str, nodes: list[ir.Node], reasons: dict[str, str], shapes: dict) -> Group:
    return Group(kind, why, reasons, [n.op_type for n in nodes], sum(multiply_adds(n, shapes) for n in nodes))
