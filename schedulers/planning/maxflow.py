"""Warm-started maximum flow with lower and upper bounds, in exact integers.

The Phillips-Dessouky step (:mod:`schedulers.planning.pd_core`) needs, on the critical part of
the activity-on-arc DAG, the minimum ``s``-``t`` cut whose capacity is the sum of the upper
bounds of the edges crossing it forwards minus the lower bounds of those crossing it backwards.
:class:`BoundedFlow` keeps one flow across solver iterations. Between two calls only a few
edges change (they join or leave the critical part, or their bounds move), so the previous
flow, clamped into the new bounds, is nearly feasible:

1. *repair*: the clamping leaves some vertices with more inflow than outflow or less; excess
   is pushed along residual paths to vertices short of flow, or to ``s``/``t`` (which need not
   balance: with lowtime's infinite return edge ``t -> s`` the problem is a circulation);
2. *augment*: shortest augmenting paths from ``s`` to ``t`` until none is left, a level graph
   at a time (Dinic: one breadth-first search, then depth-first paths through it);
3. the vertices reachable from ``s`` in the residual graph are the source side of the cut.

That set is the same for every maximum flow (it is the smallest minimum cut), so the cut
does not depend on how the flow was found: a cold start (lowtime's two Edmonds-Karp runs from
zero flow) and this warm start pick the same cut. Capacities are whole multiples of lowtime's
``FP_ERROR``, held as Python integers, so no comparison depends on rounding.
"""

from __future__ import annotations

from protocol.exceptions import ConfigError


class InfeasibleFlowError(ConfigError):
    """No flow meets every edge's bounds: a cost model gives an edge ``lb > ub`` on a path."""


class BoundedFlow:
    """A flow on a fixed set of edges, some of them active, each with ``lb <= flow <= ub``.

    Args:
        num_vertices: Vertices are ``0 .. num_vertices - 1``.
        tails: ``tails[e]``: the vertex edge ``e`` leaves.
        heads: ``heads[e]``: the vertex edge ``e`` enters.
        source: ``s``.
        sink: ``t``.

    """

    def __init__(
        self, num_vertices: int, tails: list[int], heads: list[int], source: int, sink: int
    ) -> None:
        self.tails, self.heads = tails, heads
        self.source, self.sink = source, sink
        num_edges = len(tails)
        self.lb = [0] * num_edges
        self.ub = [0] * num_edges
        self.flow = [0] * num_edges
        self.active = [False] * num_edges
        self.out_edges: list[list[int]] = [[] for _ in range(num_vertices)]
        self.in_edges: list[list[int]] = [[] for _ in range(num_vertices)]
        # (edge, vertex at its other end) per vertex, for the searches.
        self._out_pairs: list[list[tuple[int, int]]] = [[] for _ in range(num_vertices)]
        self._in_pairs: list[list[tuple[int, int]]] = [[] for _ in range(num_vertices)]
        for e, (u, v) in enumerate(zip(tails, heads, strict=True)):
            self.out_edges[u].append(e)
            self.in_edges[v].append(e)
            self._out_pairs[u].append((e, v))
            self._in_pairs[v].append((e, u))
        # (edge, other end, +1 forward / -1 backward) per vertex, for the blocking flow.
        self._adjacent: list[list[tuple[int, int, int]]] = [
            [(e, y, 1) for e, y in outs] + [(e, y, -1) for e, y in ins]
            for outs, ins in zip(self._out_pairs, self._in_pairs, strict=True)
        ]
        self.excess = [0] * num_vertices
        self.unbalanced: set[int] = set()
        self.augmentations = 0

    def _shift(self, e: int, delta: int) -> None:
        """Add ``delta`` to the flow of ``e`` and account for it at both ends."""
        if not delta:
            return
        self.flow[e] += delta
        for vertex, change in ((self.tails[e], -delta), (self.heads[e], delta)):
            if vertex == self.source or vertex == self.sink:
                continue
            self.excess[vertex] += change
            if self.excess[vertex]:
                self.unbalanced.add(vertex)
            else:
                self.unbalanced.discard(vertex)

    def set_edge(self, e: int, active: bool, lb: int = 0, ub: int = 0) -> None:
        """Activate (with bounds) or deactivate edge ``e``; its flow is clamped into them."""
        if not active:
            self.active[e] = False
            self._shift(e, -self.flow[e])
            self.lb[e] = self.ub[e] = 0  # No residual either way: searches need not test active.
            return
        self.active[e] = True
        self.lb[e], self.ub[e] = lb, ub
        f = self.flow[e]
        self._shift(e, min(max(f, lb), ub) - f)

    def _search(self, starts: list[int], targets: set[int], reverse: bool) -> int:
        """Breadth-first search of the residual graph; return the target found or -1.

        Leaves ``self._via`` with ``(edge, +1 forward / -1 backward)`` per reached vertex. With
        ``reverse`` the search follows residual arcs against their direction.
        """
        via: dict[int, tuple[int, int]] = dict.fromkeys(starts, (-1, 0))
        self._via = via
        order = list(starts)
        flow, lb, ub = self.flow, self.lb, self.ub
        ahead, behind = (
            (self._in_pairs, self._out_pairs) if reverse else (self._out_pairs, self._in_pairs)
        )
        for x in order:  # The loop also visits what it appends.
            for e, y in ahead[x]:
                if y not in via and flow[e] < ub[e]:
                    via[y] = (e, 1)
                    if y in targets:
                        return y
                    order.append(y)
            for e, y in behind[x]:
                if y not in via and flow[e] > lb[e]:
                    via[y] = (e, -1)
                    if y in targets:
                        return y
                    order.append(y)
        return -1

    def _path(self, end: int, reverse: bool) -> tuple[list[tuple[int, int]], int, int]:
        """Arcs from the search start to ``end``, their bottleneck and the start vertex."""
        arcs: list[tuple[int, int]] = []
        bottleneck = -1
        x = end
        while True:
            e, sign = self._via[x]
            if e < 0:
                break
            arcs.append((e, sign))
            room = self.ub[e] - self.flow[e] if sign > 0 else self.flow[e] - self.lb[e]
            bottleneck = room if bottleneck < 0 else min(bottleneck, room)
            if sign > 0:
                x = self.heads[e] if reverse else self.tails[e]
            else:
                x = self.tails[e] if reverse else self.heads[e]
        return arcs, bottleneck, x

    def _push(
        self, arcs: list[tuple[int, int]], amount: int, origin: int = -1, dest: int = -1
    ) -> None:
        """Send ``amount`` along a path of ``(edge, sign)`` from ``origin`` to ``dest``.

        Inner vertices stay balanced; only the ends' excess moves (``s`` and ``t``, or -1,
        keep none).
        """
        flow = self.flow
        for e, sign in arcs:
            flow[e] += sign * amount
        for vertex, change in ((origin, -amount), (dest, amount)):
            if vertex < 0 or vertex == self.source or vertex == self.sink:
                continue
            self.excess[vertex] += change
            if self.excess[vertex]:
                self.unbalanced.add(vertex)
            else:
                self.unbalanced.discard(vertex)
        self.augmentations += 1

    def _repair(self) -> None:
        """Balance every vertex but ``s`` and ``t`` (phase 1)."""
        free = {self.source, self.sink}
        while True:
            givers = sorted(v for v in self.unbalanced if self.excess[v] > 0)
            if not givers:
                break
            takers = {v for v in self.unbalanced if self.excess[v] < 0} | free
            end = self._search(givers, takers, reverse=False)
            if end < 0:
                raise InfeasibleFlowError(_INFEASIBLE)
            arcs, room, start = self._path(end, reverse=False)
            amount = self.excess[start]
            if room >= 0:
                amount = min(amount, room)
            if end not in free:
                amount = min(amount, -self.excess[end])
            self._push(arcs, amount, start, end)
        while self.unbalanced:
            needy = sorted(self.unbalanced)
            end = self._search(needy, free, reverse=True)
            if end < 0:
                raise InfeasibleFlowError(_INFEASIBLE)
            arcs, room, start = self._path(end, reverse=True)
            amount = -self.excess[start]
            if room >= 0:
                amount = min(amount, room)
            self._push(arcs, amount, end, start)

    def _levels(self) -> dict[int, int]:
        """Breadth-first distances from ``s`` in the residual graph.

        Stops after the level of ``t`` if ``t`` is reached; otherwise the keys are every
        vertex reachable from ``s``.
        """
        flow, lb, ub, sink = self.flow, self.lb, self.ub, self.sink
        level = {self.source: 0}
        order = [self.source]
        last = -1  # The level of t once found.
        for x in order:  # The loop also visits what it appends.
            here = level[x]
            if here == last:
                break
            for e, y in self._out_pairs[x]:
                if y not in level and flow[e] < ub[e]:
                    level[y] = here + 1
                    order.append(y)
            for e, y in self._in_pairs[x]:
                if y not in level and flow[e] > lb[e]:
                    level[y] = here + 1
                    order.append(y)
            if last < 0 and sink in level:
                last = level[sink]
        return level

    def _blocking_flow(self, level: dict[int, int]) -> None:
        """Augment along shortest paths until none is left at these levels (Dinic)."""
        flow, lb, ub, sink = self.flow, self.lb, self.ub, self.sink
        adj = self._adjacent
        cursor = dict.fromkeys(level, 0)
        while True:
            path: list[tuple[int, int]] = []
            x = self.source
            while x != sink:
                arcs, k, step = adj[x], cursor[x], None
                want = level[x] + 1
                while k < len(arcs):
                    e, y, sign = arcs[k]
                    if level.get(y) == want and (flow[e] < ub[e] if sign > 0 else flow[e] > lb[e]):
                        step = (e, y, sign)
                        break
                    k += 1
                cursor[x] = k
                if step is None:  # Dead end: drop x, step back.
                    level[x] = -1
                    if not path:
                        return
                    e, sign = path.pop()
                    x = self.tails[e] if sign > 0 else self.heads[e]
                    cursor[x] += 1
                    continue
                path.append((step[0], step[2]))
                x = step[1]
            room = min(ub[e] - flow[e] if sign > 0 else flow[e] - lb[e] for e, sign in path)
            self._push(path, room)

    def min_cut(self) -> dict[int, int]:
        """Make the flow feasible and maximum; return the source side of the minimum cut.

        Returns:
            The vertices reachable from ``s`` in the residual graph (as the keys of a dict).

        Raises:
            InfeasibleFlowError: No feasible flow.

        """
        self._repair()
        while True:
            level = self._levels()
            if self.sink not in level:
                return level
            self._blocking_flow(level)


_INFEASIBLE = (
    "no feasible flow in the Phillips-Dessouky step: an instruction's cost model is not "
    "convex (lower bound above upper bound on the critical path)"
)
