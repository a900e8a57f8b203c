"""Profiled energy and iteration time of a plan, kept up to date as its clocks change.

A frontier of thousands of points differs from one point to the next in a few clocks, so
:class:`PlanEvaluator` updates its figures instead of re-evaluating the whole pipeline: energy
and time sums from per-option counts, the longest path by repairing start times downstream of
the changed instructions only (in topological order, stopping where nothing changes). The
figures equal a fresh evaluation's: the longest path is the same maximum of the same sums.
"""

from __future__ import annotations

import heapq

from schedulers.planning.core_problem import CoreProblem


class PlanEvaluator:
    """Figures of a plan given as one option index per node.

    Args:
        problem: The problem the options index into.
        options: Option index per node.

    """

    def __init__(self, problem: CoreProblem, options: list[int]) -> None:
        self.problem = problem
        shape = problem.shape
        self.preds = shape.preds
        self.succs: list[list[int]] = [[] for _ in range(shape.num_nodes)]
        for v, ps in enumerate(shape.preds):
            for p in ps:
                self.succs[p].append(v)
        self.pos = [0] * shape.num_nodes
        for k, v in enumerate(shape.topo):
            self.pos[v] = k
        self.ends = [v for v in range(shape.num_nodes) if not self.succs[v]]
        self.options = list(options)
        self.counts = [[0] * len(t.options) for t in problem.tables]
        for v, o in enumerate(options):
            self.counts[problem.node_table[v]][o] += 1
        self.rt = [problem.option_time[problem.node_table[v]][o] for v, o in enumerate(options)]
        self.start = [0.0] * shape.num_nodes
        for v in shape.topo:
            self.start[v] = max((self.start[p] + self.rt[p] for p in self.preds[v]), default=0.0)

    def change(self, moves: list[tuple[int, int]]) -> None:
        """Apply ``(node, option)`` moves."""
        problem, start, rt, pos = self.problem, self.start, self.rt, self.pos
        for v, o in moves:
            t = problem.node_table[v]
            self.counts[t][self.options[v]] -= 1
            self.counts[t][o] += 1
            self.options[v] = o
            rt[v] = problem.option_time[t][o]
        heap = [(pos[s], s) for v, _ in moves for s in self.succs[v]]
        heapq.heapify(heap)
        seen: set[int] = set()
        while heap:
            _, v = heapq.heappop(heap)
            if v in seen:
                continue
            seen.add(v)
            value = max(start[p] + rt[p] for p in self.preds[v])
            if value != start[v]:
                start[v] = value
                for s in self.succs[v]:
                    heapq.heappush(heap, (pos[s], s))

    def figures(self) -> tuple[float, float, float]:
        """``(energy J, sum of instruction times s, longest path s)`` of the current clocks."""
        energy = time_sum = 0.0
        for t, row in enumerate(self.counts):
            for o, count in enumerate(row):
                if count:
                    energy += count * self.problem.option_energy[t][o]
                    time_sum += count * self.problem.option_time[t][o]
        makespan = max(self.start[v] + self.rt[v] for v in self.ends)
        return energy, time_sum, makespan
