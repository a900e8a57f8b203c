"""The Phillips-Dessouky iteration in pure Python, incremental where lowtime recomputes.

Same algorithm as lowtime's ``PhillipsDessouky.run``, step for step:

1. every instruction starts at its slowest duration (plan 0);
2. the *critical* part of the activity-on-arc DAG is the set of edges with zero float (an
   instruction ``i`` is the arc ``2i -> 2i+1``, a dependency ``u -> v`` the dummy arc
   ``2u+1 -> 2v``; a virtual source and sink close the graph);
3. each critical instruction gets flow bounds from its cost model (the marginal cost of
   slowing it down one unit as the lower bound, of speeding it up as the upper bound; see
   :class:`~schedulers.planning.cost_model.CostTable`), dummies ``[0, inf)``;
4. the minimum cut of that network picks the instructions to speed up (arcs crossing it
   forwards) and to slow down (arcs crossing it backwards) by one unit; the iteration time
   drops by one unit at the least added cost;
5. the step ends the run, where lowtime stops, when a forward arc is a dummy or already at its
   fastest, a backward arc is at its slowest, or no arc crosses forwards. lowtime also stops
   when a step's cost change is below ``FP_ERROR``; the core takes such a step: where an
   energy curve flattens at its slow end, the first speed-ups cost almost nothing, and stopping
   there ended the frontier at its slowest plan (every step still shortens the iteration by
   one unit, so the run ends).

Where lowtime rebuilds everything per step (networkx copies, three topological sorts, two
max-flows from zero), this keeps state across steps: start times and tails of the longest
paths are repaired only downstream/upstream of the changed instructions (stopping where a value
does not change), criticality is one comparison per arc on those values, only arcs whose
criticality or bounds changed are handed to the flow, and the flow is warm-started
(:class:`~schedulers.planning.maxflow.BoundedFlow`). Flow bounds are exact integers, so the cut
is the smallest minimum cut, which no max-flow order changes (lowtime's floating-point flow can
pick another minimum cut of equal model cost where a residual is exactly one ``FP_ERROR``).
"""

from __future__ import annotations

from collections.abc import Callable

from schedulers.planning.core_problem import CoreProblem, CoreResult
from schedulers.planning.cost_model import INF_UNITS
from schedulers.planning.maxflow import BoundedFlow
from schedulers.planning.plan_eval import PlanEvaluator

#: ``progress(point index, quantized time of that point)``.
CoreProgress = Callable[[int, int], None]


class _Dag:
    """The AON DAG with a virtual source (node N) and sink (node N+1) and its AOA arcs."""

    def __init__(self, problem: CoreProblem) -> None:
        shape = problem.shape
        n = shape.num_nodes
        self.n = n
        self.src, self.snk = n, n + 1
        preds: list[list[int]] = [list(ps) for ps in shape.preds] + [[], []]
        succs: list[list[int]] = [[] for _ in range(n + 2)]
        for v in range(n):
            for p in preds[v]:
                succs[p].append(v)
        for v in range(n):
            if not preds[v]:
                preds[v].append(self.src)
                succs[self.src].append(v)
        for v in range(n):
            if not succs[v]:
                succs[v].append(self.snk)
                preds[self.snk].append(v)
        self.preds, self.succs = preds, succs
        self.topo = [self.src, *shape.topo, self.snk]
        self.pos = [0] * (n + 2)
        for k, v in enumerate(self.topo):
            self.pos[v] = k
        # Arcs: 0..n+1 are the nodes' own arcs, then one dummy arc per dependency.
        self.tails = [2 * v for v in range(n + 2)]
        self.heads = [2 * v + 1 for v in range(n + 2)]
        self.dep_ends: list[tuple[int, int]] = []
        self.in_deps: list[list[int]] = [[] for _ in range(n + 2)]
        self.out_deps: list[list[int]] = [[] for _ in range(n + 2)]
        for v in range(n + 2):
            for s in succs[v]:
                e = len(self.tails)
                self.tails.append(2 * v + 1)
                self.heads.append(2 * s)
                self.dep_ends.append((v, s))
                self.out_deps[v].append(e)
                self.in_deps[s].append(e)


class _Solver:
    """State of one run (see the module docstring)."""

    def __init__(self, problem: CoreProblem) -> None:
        self.problem = problem
        dag = self.dag = _Dag(problem)
        n = dag.n
        self.tables = [problem.tables[t] for t in problem.node_table]
        self.d = [t.max_d for t in self.tables] + [0, 0]
        self.head = [0] * (n + 2)
        self.tail = [0] * (n + 2)
        for v in dag.topo:
            self.head[v] = max((self.head[p] + self.d[p] for p in dag.preds[v]), default=0)
        for v in reversed(dag.topo):
            self.tail[v] = max((self.d[s] + self.tail[s] for s in dag.succs[v]), default=0)
        self.dirty = [False] * (n + 2)
        self.flow = BoundedFlow(2 * (n + 2), dag.tails, dag.heads, 2 * dag.src, 2 * dag.snk + 1)
        self.critical = [False] * len(dag.tails)

    @property
    def makespan(self) -> int:
        """Iteration time in units."""
        return self.tail[self.dag.src]

    def bounds(self, e: int) -> tuple[int, int]:
        """Flow bounds of arc ``e`` at the current durations."""
        if e < self.dag.n:
            table = self.tables[e]
            k = self.d[e] - table.min_d
            return table.lb[k], table.ub[k]
        return 0, INF_UNITS

    def _propagate(self, changed: list[int], forward: bool) -> None:
        """Recompute heads (or tails) downstream (upstream) of ``changed``, in topological order.

        Only marked nodes are recomputed, and a node whose value stays the same marks nothing.
        """
        dag, d, dirty = self.dag, self.d, self.dirty
        nexts, prevs = (dag.succs, dag.preds) if forward else (dag.preds, dag.succs)
        values = self.head if forward else self.tail
        first = len(dag.topo)
        for v in changed:
            for w in nexts[v]:
                dirty[w] = True
                k = dag.pos[w] if forward else len(dag.topo) - 1 - dag.pos[w]
                first = min(first, k)
        order = dag.topo if forward else dag.topo[::-1]
        for k in range(first, len(order)):
            v = order[k]
            if not dirty[v]:
                continue
            dirty[v] = False
            if forward:
                value = max(values[p] + d[p] for p in prevs[v])
            else:
                value = max(d[p] + values[p] for p in prevs[v])
            if value != values[v]:
                values[v] = value
                for w in nexts[v]:
                    dirty[w] = True

    def refresh(self, changed: list[int]) -> None:
        """Repair longest paths and the flow after the durations of ``changed`` moved."""
        self._propagate(changed, forward=True)
        self._propagate(changed, forward=False)
        dag, head, tail, d = self.dag, self.head, self.tail, self.d
        makespan = self.makespan
        finish = [h + x for h, x in zip(head, d, strict=True)]
        latest = [x + t for x, t in zip(d, tail, strict=True)]
        now = [f + t == makespan for f, t in zip(finish, tail, strict=True)]
        now += [finish[u] + latest[v] == makespan for u, v in dag.dep_ends]
        flow, was = self.flow, self.critical
        for e in [e for e, (a, b) in enumerate(zip(was, now, strict=True)) if a != b]:
            if now[e]:
                flow.set_edge(e, True, *self.bounds(e))
            else:
                flow.set_edge(e, False)
        for v in changed:
            if now[v] and was[v]:
                flow.set_edge(v, True, *self.bounds(v))
        self.critical = now

    def step(self) -> tuple[str, list[tuple[int, int]]]:
        """One Phillips-Dessouky step.

        Returns:
            ``("", [(node, old duration), ...])`` by node, or ``(reason to stop, [])``.

        """
        reach = self.flow.min_cut()
        flow, dag, n = self.flow, self.dag, self.dag.n
        speed, slow = [], []
        for x in reach:
            for e in flow.out_edges[x]:
                if flow.active[e] and dag.heads[e] not in reach:
                    speed.append(e)
            for e in flow.in_edges[x]:
                if flow.active[e] and dag.tails[e] not in reach:
                    slow.append(e)
        if not speed:
            return "no arc crosses the cut forwards", []
        speed.sort()
        slow.sort()
        d, tables = self.d, self.tables
        for e in speed:
            if e >= n:
                return "a dependency or the source/sink is on the cut", []
            if d[e] - 1 < tables[e].min_d:
                return "an instruction on the cut is at its fastest", []
        real_slow = [e for e in slow if e < n]
        for e in real_slow:
            if d[e] + 1 > tables[e].max_d:
                return "an instruction on the cut is at its slowest", []
        moved = sorted([(e, d[e]) for e in speed] + [(e, d[e]) for e in real_slow])
        for e in speed:
            d[e] -= 1
        for e in real_slow:
            d[e] += 1
        return "", moved


def solve(problem: CoreProblem, progress: CoreProgress | None = None) -> CoreResult:
    """Run the Phillips-Dessouky iteration to the fastest point; return every point."""
    solver = _Solver(problem)
    n = solver.dag.n
    tables = solver.tables
    options = [tables[v].option_at[solver.d[v] - tables[v].min_d] for v in range(n)]
    evaluator = PlanEvaluator(problem, options)
    cost = 0.0
    for v in range(n):  # A plain loop, as the C kernel (sum() compensates since Python 3.12).
        cost += tables[v].cost[solver.d[v] - tables[v].min_d]
    result = CoreResult([], [], [], [], [], list(options), [])

    def record(moves: list[tuple[int, int]]) -> None:
        point = result.add_point(solver.makespan, cost, evaluator.figures(), moves)
        if progress is not None:
            progress(point, solver.makespan)

    record([])
    solver.refresh([])
    while True:
        stop, moved = solver.step()
        if stop:
            result.stop = stop
            break
        moves = []
        for v, old in moved:
            table = tables[v]
            k = solver.d[v] - table.min_d
            cost += table.cost[k] - table.cost[old - table.min_d]
            o = table.option_at[k]
            if o != evaluator.options[v]:
                moves.append((v, o))
        evaluator.change(moves)
        solver.refresh([v for v, _ in moved])
        record(moves)
    result.stats = {
        "steps": len(result.quant_times) - 1,
        "augmenting_paths": solver.flow.augmentations,
    }
    return result
