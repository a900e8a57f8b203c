"""A synchronous pipeline (1F1B or GPipe) as a DAG: a lowtime-free shape, and the lowtime graph.

:class:`PipelineShape` knows the instruction order of every stage (from
:mod:`protocol.pipeline_schedules`) and the dependencies between instructions,
and computes start/finish times for given durations. It needs no
lowtime (whose import costs close to a second), so the chooser, the plots and the tests use it.

:func:`build_lowtime_dag` turns a shape into the activity-on-node graph that lowtime's
Phillips-Dessouky solver takes. Its edges are

* the execution order within a stage (a GPU runs one instruction at a time), and
* ``Forward(s, m) -> Forward(s+1, m)`` and ``Backward(s+1, m) -> Backward(s, m)``: lowtime's
  ``forward_dep`` / ``backward_dep`` rules.

lowtime's examples find the second kind by testing every pair of instructions with a
``DependencyResolver`` (O(n^2)); here each instruction's partner is looked up by
``(stage, microbatch)`` in O(1), and every edge is still checked against the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from protocol.constants import INSTRUCTIONS
from protocol.exceptions import ConfigError
from protocol.pipeline_schedules import (
    DEFAULT_SCHEDULE,
    check_schedule,
    one_f_one_b_order,
    stage_order,
)

__all__ = [
    "MAX_INSTRUCTIONS",
    "PipelineShape",
    "build_lowtime_dag",
    "check_instructions",
    "check_job_instructions",
    "instruction_count",
    "one_f_one_b_order",
]

#: Most instructions the planner takes unless told more (``perseus optimize --max-instructions``,
#: a ``max_instructions`` argument: :func:`check_instructions`). The
#: planner's time grows about with the square of the count (compiled core, synthetic profile,
#: 2-core machine: 16x64 = 2,048 in 2.4 s, 32x256 = 16,384 in 75 s; the pure-Python core took
#: 52 s for 2,048), so this many take about an hour with the compiled core and days without;
#: real pipelines have a few thousand. A typo such as ``-m 640000`` built millions: weeks.
MAX_INSTRUCTIONS = 100_000


def instruction_count(num_stages: int, num_microbatches: int) -> int:
    """Instructions (DAG nodes) of a pipeline: a forward and a backward per stage and microbatch."""
    return 2 * num_stages * num_microbatches


def check_instructions(
    num_stages: int,
    num_microbatches: int,
    limit: int = MAX_INSTRUCTIONS,
    *,
    shape: str | None = None,
    raise_with: str = "pass max_instructions=N",
) -> None:
    """Raise ConfigError for a pipeline of more than ``limit`` instructions, before any work.

    Every path to the planner checks with this (``perseus optimize``, the rq planning job,
    the schedulers that plan): ``-m 640000``, a typo for 64, built a DAG of millions of
    instructions, and the planner hung or ran out of memory.

    Args:
        num_stages: Pipeline stages.
        num_microbatches: Microbatches per iteration.
        limit: The most instructions allowed (>= 1).
        shape: How the message names the two numbers (default ``stages S x microbatches M``);
            it is followed by ``make N instructions``.
        raise_with: How the caller raises ``limit``, as in "..., or {raise_with} to plan more".

    Raises:
        ConfigError: ``limit`` is below 1, or the pipeline has more instructions.
    """
    if limit < 1:
        raise ConfigError(f"max_instructions must be >= 1, got {limit}")
    count = instruction_count(num_stages, num_microbatches)
    if count <= limit:
        return
    shape = shape or f"stages {num_stages} x microbatches {num_microbatches}"
    raise ConfigError(
        f"{shape} make {count:,} instructions (2 per stage and microbatch); the planner takes "
        f"at most {limit:,}, since its time grows about with the square of the count; check "
        f"both numbers, or {raise_with} to plan more"
    )


def check_job_instructions(
    owner: str, stages: int | None, microbatches: int, limit: int, raise_with: str
) -> None:
    """:func:`check_instructions` for a scheduler's arguments, named after ``owner``.

    Args:
        owner: What the message starts with (``FrontierScheduler``, ``then``).
        stages: The job's stages (``pp_degree``); None where no job is known yet (the
            coordinator's start): checked for one stage.
        microbatches: Microbatches per iteration.
        limit: The most instructions allowed.
        raise_with: How the user raises ``limit``.

    Raises:
        ConfigError: Over the limit, the reason led by ``owner``.
    """
    shape = (
        f"microbatches {microbatches}, even on 1 stage,"
        if stages is None
        else f"pp_degree {stages} x microbatches {microbatches}"
    )
    try:
        check_instructions(stages or 1, microbatches, limit, shape=shape, raise_with=raise_with)
    except ConfigError as exc:
        raise ConfigError(f"{owner}: {exc}") from None


if TYPE_CHECKING:
    import networkx as nx


class PipelineShape:
    """Instructions and dependencies of a synchronous pipeline (1F1B or GPipe).

    Node ``i`` is an instruction; nodes are numbered stage by stage in execution order, so
    ``node(s, k)`` is the ``k``-th instruction that stage ``s`` runs.

    Args:
        num_stages: Pipeline stages ``S``.
        num_microbatches: Microbatches per iteration ``M``.
        schedule: ``"1f1b"`` (default) or ``"gpipe"``: the order each stage runs its
            instructions in (the dependencies between stages are the same).

    Attributes:
        schedule_name: The schedule, ``"1f1b"`` or ``"gpipe"``.
        order: ``order[s]`` lists stage ``s``'s instruction names in execution order.
        nodes: ``nodes[i] = (stage, instruction, microbatch)``.
        preds: ``preds[i]`` lists the nodes that must finish before node ``i`` starts.
        topo: All nodes in a topological order.

    """

    def __init__(
        self, num_stages: int, num_microbatches: int, schedule: str = DEFAULT_SCHEDULE
    ) -> None:
        self.schedule_name = check_schedule(schedule)
        if num_stages < 1 or num_microbatches < 1:
            raise ConfigError(
                f"need at least 1 stage and 1 microbatch, got {num_stages} and {num_microbatches}"
            )
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.order = [
            stage_order(schedule, num_stages, num_microbatches, s) for s in range(num_stages)
        ]
        self.nodes: list[tuple[int, str, int]] = []
        self._index: dict[tuple[int, str, int], int] = {}
        for s, names in enumerate(self.order):
            seen = dict.fromkeys(INSTRUCTIONS, 0)  # Microbatches run in order per kind.
            for name in names:
                key = (s, name, seen[name])
                seen[name] += 1
                self._index[key] = len(self.nodes)
                self.nodes.append(key)
        self.preds: list[list[int]] = [[] for _ in self.nodes]
        for i, (s, name, m) in enumerate(self.nodes):
            if i > 0 and self.nodes[i - 1][0] == s:
                self.preds[i].append(i - 1)
            upstream = s - 1 if name == "forward" else s + 1
            if 0 <= upstream < num_stages:
                self.preds[i].append(self._index[(upstream, name, m)])
        self.topo = self._topological_order()

    @property
    def num_nodes(self) -> int:
        """Number of instructions, ``2 * S * M``."""
        return len(self.nodes)

    def node(self, stage: int, position: int) -> int:
        """Node id of the ``position``-th instruction of ``stage``."""
        return stage * 2 * self.num_microbatches + position

    def node_of(self, stage: int, instruction: str, microbatch: int) -> int:
        """Node id of an instruction by what it computes."""
        return self._index[(stage, instruction, microbatch)]

    def edges(self) -> list[tuple[int, int]]:
        """All dependency edges ``(before, after)``."""
        return [(p, i) for i, ps in enumerate(self.preds) for p in ps]

    def _topological_order(self) -> list[int]:
        succs: list[list[int]] = [[] for _ in self.nodes]
        indeg = [len(ps) for ps in self.preds]
        for i, ps in enumerate(self.preds):
            for p in ps:
                succs[p].append(i)
        ready = [i for i, d in enumerate(indeg) if d == 0]
        out: list[int] = []
        while ready:
            i = ready.pop()
            out.append(i)
            for j in succs[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    ready.append(j)
        if len(out) != len(self.nodes):  # pragma: no cover - both schedules are acyclic
            raise AssertionError(f"{self.schedule_name} dependency graph has a cycle")
        return out

    def schedule(self, durations: Sequence[float]) -> tuple[list[float], list[float]]:
        """Earliest start and finish of every node, each starting when its inputs are done.

        Args:
            durations: ``durations[i]`` of node ``i`` (any unit).

        Returns:
            ``(start, finish)`` lists indexed by node.

        """
        start = [0.0] * len(self.nodes)
        finish = [0.0] * len(self.nodes)
        for i in self.topo:
            t = max((finish[p] for p in self.preds[i]), default=0.0)
            start[i] = t
            finish[i] = t + durations[i]
        return start, finish

    def makespan(self, durations: Sequence[float]) -> float:
        """Return the iteration time: the longest dependency path for the given durations."""
        return max(self.schedule(durations)[1])

    def max_path_length(self) -> int:
        """Most instructions on any dependency path (bounds the rounding of quantized time)."""
        return int(self.makespan([1.0] * len(self.nodes)))

    def durations(self, per_instruction: Mapping[tuple[int, str], float]) -> list[float]:
        """Durations by node from one figure per ``(stage, instruction)``."""
        return [per_instruction[(s, name)] for s, name, _ in self.nodes]


def build_lowtime_dag(
    shape: PipelineShape, specs: Mapping[tuple[int, str], Any]
) -> tuple[nx.DiGraph, list[Any]]:
    """Build lowtime's activity-on-node DAG of the pipeline.

    Args:
        shape: The pipeline.
        specs: ``specs[(stage, instruction)]``: the lowtime ``OperationSpec`` to use.

    Returns:
        ``(graph, ops)``: the graph (node attribute ``"op"``, with ``source_node`` and
        ``sink_node`` graph attributes), and ``ops[i]``, the lowtime instruction of node ``i``.

    Raises:
        AssertionError: lowtime's ``Synchronous1F1B`` order (for a 1F1B shape) or its
            dependency rules disagree with the shape (a lowtime change this code would have
            to follow).

    lowtime has no GPipe schedule; for a GPipe shape the instructions are made directly in
    the shape's order (the dependency rules are the same).
    """
    import networkx as nx
    from lowtime.graph_utils import DependencyResolver, add_sink_node, add_source_node
    from lowtime.perseus.instruction import (
        Backward,
        Forward,
        Instruction,
        backward_dep,
        forward_dep,
    )
    from lowtime.perseus.schedule import Synchronous1F1B

    S, M = shape.num_stages, shape.num_microbatches
    graph = nx.DiGraph()
    ops: list[Any] = [None] * shape.num_nodes
    for s in range(S):
        spec_map = {Forward: specs[(s, "forward")], Backward: specs[(s, "backward")]}
        if shape.schedule_name == "1f1b":
            stage_ops: Any = Synchronous1F1B(S, M, s, spec_map)
        else:
            kinds = {"forward": Forward, "backward": Backward}
            stage_ops = [
                kinds[name](spec=spec_map[kinds[name]], stage_id=s, micro_batch_id=m)
                for _, name, m in shape.nodes[shape.node(s, 0) : shape.node(s, 2 * M)]
            ]
        for k, inst in enumerate(stage_ops):
            node = shape.node(s, k)
            name = "forward" if isinstance(inst, Forward) else "backward"
            if shape.nodes[node] != (inst.stage_id, name, inst.micro_batch_id):
                raise AssertionError(
                    f"lowtime 1F1B order differs at stage {s} position {k}: "
                    f"{shape.nodes[node]} vs {inst}"
                )
            ops[node] = inst
            graph.add_node(node, op=inst)
    resolver = DependencyResolver([forward_dep, backward_dep], Instruction)
    for before, after in shape.edges():
        same_stage = shape.nodes[before][0] == shape.nodes[after][0]
        if not same_stage and not resolver.is_dependent(ops[before], ops[after]):
            raise AssertionError(f"edge {ops[before]} -> {ops[after]} breaks lowtime's rules")
        graph.add_edge(before, after)
    source, sink = shape.num_nodes, shape.num_nodes + 1
    add_source_node(graph, source)
    add_sink_node(graph, sink)
    graph.graph["source_node"] = source
    graph.graph["sink_node"] = sink
    return graph, ops
