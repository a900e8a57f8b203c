"""The warm-started bounded max-flow finds the smallest minimum cut, checked by enumeration.

Random small networks get a feasible flow by construction (bounds drawn around a circulation),
then the cut is compared with every ``s``-``t`` cut: its capacity (upper bounds forwards minus
lower bounds backwards) must be the least, and its source side must lie inside every other
minimum cut's. The same flow object is then changed (edges deactivated, bounds moved) and asked
again, as the solver does between steps.
"""

from __future__ import annotations

import random

import pytest

from schedulers.planning.maxflow import BoundedFlow, InfeasibleFlowError


def random_network(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    """A DAG on ``n`` vertices (0 = s, n-1 = t) where every vertex is on an s-t path."""
    tails, heads = [], []
    for v in range(1, n):
        u = rng.randrange(v)
        tails.append(u)
        heads.append(v)
    for v in range(n - 1):
        w = rng.randrange(v + 1, n)
        tails.append(v)
        heads.append(w)
    for _ in range(n):
        u, w = sorted(rng.sample(range(n), 2))
        tails.append(u)
        heads.append(w)
    return tails, heads


def feasible_bounds(
    rng: random.Random, n: int, tails: list[int], heads: list[int]
) -> list[tuple[int, int, int]]:
    """``(lb, ub, flow)`` around a random s-t flow made of paths: a feasible flow exists."""
    flow = [0] * len(tails)
    out = [[e for e, u in enumerate(tails) if u == v] for v in range(n)]
    for _ in range(rng.randint(1, 4)):
        v, amount = 0, rng.randint(1, 9)
        while v != n - 1:
            e = rng.choice(out[v])
            flow[e] += amount
            v = heads[e]
    return [(max(0, f - rng.randint(0, 5)), f + rng.randint(0, 5), f) for f in flow]


def best_cuts(
    n: int, tails: list[int], heads: list[int], bounds: dict[int, tuple[int, int]]
) -> tuple[int, list[frozenset[int]]]:
    best, cuts = None, []
    for mask in range(1 << (n - 2)):
        side = frozenset([0] + [v + 1 for v in range(n - 2) if mask >> v & 1])
        cap = 0
        for e, (lb, ub) in bounds.items():
            if tails[e] in side and heads[e] not in side:
                cap += ub
            elif heads[e] in side and tails[e] not in side:
                cap -= lb
        if best is None or cap < best:
            best, cuts = cap, [side]
        elif cap == best:
            cuts.append(side)
    assert best is not None
    return best, cuts


def check(flow: BoundedFlow, n: int, tails: list[int], heads: list[int], bounds: dict) -> None:
    side = frozenset(flow.min_cut())
    _, cuts = best_cuts(n, tails, heads, bounds)
    assert side in cuts
    assert all(side <= other for other in cuts)
    for e, (lb, ub) in bounds.items():
        assert lb <= flow.flow[e] <= ub
    for v in range(1, n - 1):
        inflow = sum(flow.flow[e] for e in bounds if heads[e] == v)
        outflow = sum(flow.flow[e] for e in bounds if tails[e] == v)
        assert inflow == outflow


@pytest.mark.parametrize("seed", range(40))
def test_min_cut_is_the_smallest_minimum_cut(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(3, 8)
    tails, heads = random_network(rng, n)
    bounds = {e: (lb, ub) for e, (lb, ub, _) in enumerate(feasible_bounds(rng, n, tails, heads))}
    flow = BoundedFlow(n, tails, heads, 0, n - 1)
    for e, (lb, ub) in bounds.items():
        flow.set_edge(e, True, lb, ub)
    check(flow, n, tails, heads, bounds)
    # Warm start: new bounds around another feasible flow, some unused edges switched off.
    for _ in range(3):
        fresh = feasible_bounds(rng, n, tails, heads)
        bounds = {}
        for e, (lb, ub, f) in enumerate(fresh):
            if f == 0 and rng.random() < 0.5:
                flow.set_edge(e, False)
            else:
                flow.set_edge(e, True, lb, ub)
                bounds[e] = (lb, ub)
        check(flow, n, tails, heads, bounds)


def test_infeasible_bounds_raise() -> None:
    # s -> a -> t: the first edge must carry at least 5, the second at most 3.
    flow = BoundedFlow(3, [0, 1], [1, 2], 0, 2)
    flow.set_edge(0, True, 5, 9)
    flow.set_edge(1, True, 0, 3)
    with pytest.raises(InfeasibleFlowError, match="not convex"):
        flow.min_cut()


def test_enumeration_helper_sees_every_cut() -> None:
    tails, heads = [0, 1, 0], [1, 2, 2]
    best, cuts = best_cuts(3, tails, heads, {0: (0, 2), 1: (0, 2), 2: (0, 1)})
    assert best == 3 and set(cuts) == {frozenset({0}), frozenset({0, 1})}
