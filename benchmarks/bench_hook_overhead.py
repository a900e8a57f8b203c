#!/usr/bin/env python
"""Hook overhead on a real training step: bare vs PerseusOptimizer variants, side by side.

One process (gloo, world size 1) runs a GPT-like pipeline stage (``--layers`` blocks of
attention + MLP, width ``--width``, bf16 on a GPU) as stage 0 of a 4-stage 1F1B schedule of 8
microbatches: 16 instructions a step, backward fed a random output gradient as the next stage
would send it. Variants, each its own job on a private coordinator and rq worker (a
PointSolution plan: forwards at the highest clock, backwards at a lower one, so every F/B
switch is a clock change):

* ``bare``: no hook.
* ``sync only``: no hook, only the synchronizations a measuring hook makes.
* ``steady``: the hook after its profiling window (``report_every=1``): it synchronizes only
  before a clock change.
* ``steady events``: the same with ``clock_sync="events"``: at a clock change the training
  thread records a CUDA event and the hook's side thread requests the clock once the GPU has
  reached it; nothing waits on the training thread.
* ``measure``: every step measured (a window that never fills): a sync at every boundary.
* ``measure+ie``: also per-instruction energy marks, from the default energy source.
* ``measure+ie counter``: the same with :class:`CounterEnergySource`, i.e. NVML's energy
  counter read on the training thread at every mark.
* ``events`` / ``events spin``: an experiment (:class:`EventTimedOptimizer`) that also times
  the profiling window with CUDA events instead of synchronizing; clocks as in ``steady
  events``, with blocking or spinning waits.

Rounds alternate the variants in blocks of ``--block`` steps (the first round is a warm-up);
each step starts on an idle GPU and ends when the GPU is done. Then a few untimed steps per
hooked variant record when each clock request was issued against when the GPU finished the
instruction before it (CUDA events against a reference taken on an idle GPU): the lag that
decides whether a plan's timing is kept.

Nothing on the GPU is changed: clocks go to a dry-run controller and NVML is reached only
through a read-only proxy (``register_read_only_module``). ``--simulate`` runs the same code
on CPU torch and the simulated GPU (host timestamps stand in for CUDA events), as the tests do.

    python benchmarks/bench_hook_overhead.py [--simulate] [--rounds 13] [--block 5] [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from worker_client.callback import Callback  # noqa: E402
from worker_client.hook.optimizer import PerseusOptimizer  # noqa: E402

STAGES, MICROBATCHES = 4, 8
VARIANTS = (
    "bare",
    "sync only",
    "steady",
    "steady events",
    "measure",
    "measure+ie",
    "measure+ie counter",
    "events",
    "events spin",
)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class HostEvent:
    """CPU stand-in for ``torch.cuda.Event``: CPU torch runs each op before returning."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        """Already complete."""

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


class Gpu:
    """The few device calls the benchmark needs, on CUDA or on the CPU (``--simulate``)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def event(self, blocking: bool = False) -> Any:
        """A recorded event; ``blocking``: its synchronize() sleeps instead of spinning."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True, blocking=blocking)
        else:
            event = HostEvent()
        event.record()
        return event


class SyncOnly(Callback):
    """No hook, only the synchronizations of a measuring one (step and instruction bounds)."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.syncs = 0

    def _sync(self) -> None:
        self.gpu.sync()
        self.syncs += 1

    on_step_begin = on_step_end = _sync

    def on_instruction_begin(self, name: str) -> None:
        self._sync()

    on_instruction_end = on_instruction_begin


class LagController:
    """Dry-run controller that also timestamps each request (``perf_counter``); never a clock."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int]] = []

    def set_frequency(self, frequency: int) -> None:
        self.calls.append((time.perf_counter(), int(frequency)))

    def stop(self) -> None:
        """Nothing to restore: no clock was changed."""


class MarkerLog:
    """marker_fn for ``clock_sync="events"``: records an event and keeps it for the lag pass."""

    def __init__(self, gpu: Gpu, blocking: bool) -> None:
        self.gpu, self.blocking = gpu, blocking
        self.made: list[Any] = []

    def __call__(self) -> Any:
        event = self.gpu.event(self.blocking)
        self.made.append(event)
        return event


class EventTimedOptimizer(PerseusOptimizer):
    """Experimental: also time a profiling window with CUDA events instead of synchronizing.

    Built with ``clock_sync="events"``, so clock changes are requested by the hook's side
    thread once the GPU reaches them, in profiling windows too; instructions are timed by event
    pairs, resolved after the step (the harness reads them). Per-step times and energy are not
    reported by this variant.
    """

    def __init__(self, *args: Any, gpu: Gpu, **kwargs: Any) -> None:
        super().__init__(*args, clock_sync="events", **kwargs)
        self.gpu = gpu
        self.event_pairs: dict[str, list[tuple[Any, Any]]] = {}

    def on_step_begin(self) -> None:
        self.order.begin_step()
        self._measuring = not self._reported

    def on_instruction_begin(self, name: str) -> None:
        frequency = self.order.begin(name)
        if frequency != self._frequency:
            self._frequency = frequency
            assert self._clocks is not None and self._marker_fn is not None
            self._clocks.request(frequency, self._marker_fn())
        if self._measuring:
            self._start_event = self.gpu.event()

    def on_instruction_end(self, name: str) -> None:
        self.order.end(name)
        if self._measuring:
            self.event_pairs.setdefault(name, []).append((self._start_event, self.gpu.event()))

    def on_step_end(self) -> None:
        self._measuring = False  # the base class would synchronize to time the step
        super().on_step_end()


def _model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    blocks = [Block(args.width, args.heads) for _ in range(args.layers)]
    return nn.Sequential(*blocks).to(device=device, dtype=dtype)


def _step(
    model: nn.Module,
    hook: Callback | None,
    data: tuple[list[torch.Tensor], list[torch.Tensor]],
    actions: list[tuple[str, int]],
    gpu: Gpu,
    boundaries: list[Any] | None = None,
) -> float:
    """One 1F1B step from an idle GPU to a finished one; seconds."""
    inputs, grads = data
    model.zero_grad(set_to_none=True)
    gpu.sync()
    start = time.perf_counter()
    outputs: dict[int, torch.Tensor] = {}
    if hook is not None:
        hook.on_step_begin()
    for name, mb in actions:
        if boundaries is not None:
            boundaries.append(gpu.event())
        if hook is not None:
            hook.on_instruction_begin(name)
        if name == "forward":
            outputs[mb] = model(inputs[mb])
        else:
            outputs.pop(mb).backward(grads[mb])
        if hook is not None:
            hook.on_instruction_end(name)
    if hook is not None:
        hook.on_step_end()
    gpu.sync()
    return time.perf_counter() - start


def _hook(variant: str, url: str, plan: str, nvml_module: str, gpu: Gpu) -> PerseusOptimizer:
    from worker_client.gpu.nvml import NVML
    from worker_client.hook.energy_source import CounterEnergySource

    kwargs: dict[str, Any] = {
        "rank": 0, "dp_rank": 0, "pp_rank": 0, "tp_rank": 0, "device_id": 0,
        "dp_degree": 1, "pp_degree": 1, "tp_degree": 1, "world_size": 1,
        "redis_url": url, "job_metadata": f"overhead-{variant.replace(' ', '-').replace('+', '-')}",
        "nvml_module": nvml_module, "controller": LagController(),
        "scheduler": "PointSolution", "scheduler_args": {"plan_text": plan},
        "report_every": 1 if variant.startswith("steady") else 10**9,
        "instruction_energy": "+ie" in variant,
    }  # fmt: skip
    if variant.endswith("counter"):
        kwargs["energy_source"] = CounterEnergySource(NVML(nvml_module), 0)
    if variant.startswith("events"):
        marks = MarkerLog(gpu, blocking=not variant.endswith("spin"))
        return EventTimedOptimizer(**kwargs, gpu=gpu, marker_fn=marks)
    if variant == "steady events":
        kwargs |= {"clock_sync": "events", "marker_fn": MarkerLog(gpu, blocking=True)}
    return PerseusOptimizer(**kwargs)


def _lags(hook: PerseusOptimizer, model: nn.Module, data: Any, actions: Any, gpu: Gpu) -> Any:
    """Untimed steps: request time minus the GPU's finish of the previous instruction, in us."""
    lags: list[float] = []
    for _ in range(5):
        gpu.sync()
        ref_host = time.perf_counter()
        ref = gpu.event()  # completes at once on an idle GPU: GPU time <-> host time
        controller: LagController = hook.controller  # type: ignore[assignment]
        seen = len(controller.calls)
        pairs: list[tuple[Any, float]] = []
        if hook._clocks is not None:  # clock_sync="events": one request per marker
            marks: MarkerLog = hook._marker_fn  # type: ignore[assignment]
            made = len(marks.made)
            _step(model, hook, data, actions, gpu)
            time.sleep(0.01)  # the side thread has made its last request
            times = [t for t, _ in controller.calls[seen:]]
            pairs = list(zip(marks.made[made:], times, strict=True))
        else:
            boundaries: list[Any] = []
            _step(model, hook, data, actions, gpu, boundaries)
            # One request per on_instruction_begin, made after the boundary event before it.
            last = None
            for event, (t, freq) in zip(boundaries, controller.calls[seen:], strict=True):
                if freq != last:  # the base hook repeats unchanged requests; only changes count
                    pairs.append((event, t))
                last = freq
        gpu.sync()
        for event, t in pairs:
            done = ref_host + ref.elapsed_time(event) / 1e3
            lags.append((t - done) * 1e6)
    return lags


def _instruction_ms(hook: PerseusOptimizer) -> dict[str, float]:
    """Median measured time of each instruction, ms (events resolved after a sync)."""
    if isinstance(hook, EventTimedOptimizer):
        return {
            name: statistics.median(a.elapsed_time(b) for a, b in pairs)
            for name, pairs in hook.event_pairs.items()
        }
    return {
        name: statistics.median(t for step in steps for t in step) * 1e3
        for name, steps in hook._breakdown.items()
    }


def _counter_read_ms(nvml_module: str, reads: int = 50) -> float:
    from worker_client.gpu.nvml import NVML

    nvml = NVML(nvml_module)
    start = time.perf_counter()
    for _ in range(reads):
        nvml.total_energy_mj(0)
    return (time.perf_counter() - start) / reads * 1e3


def _plan(nvml_module: str, folder: Path) -> tuple[str, int, int]:
    """A one-stage plan: forwards at the highest clock, backwards a few steps lower."""
    from protocol.pipeline_schedules import stage_order
    from schedulers.planning.plan_file import write_plan_file
    from worker_client.gpu.nvml import NVML

    clocks = NVML(nvml_module).graphics_clocks(0)
    high, low = clocks[0], clocks[min(5, len(clocks) - 1)]
    order = stage_order("1f1b", STAGES, MICROBATCHES, 0)
    line = [(n, high if n == "forward" else low) for n in order]
    path = folder / "plan.py"
    write_plan_file(path, [line], {})
    return path.read_text(), high, low


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--simulate", action="store_true", help="CPU torch + the simulated GPU")
    p.add_argument("--rounds", type=int, default=13, help="rounds; the first is a warm-up")
    p.add_argument("--block", type=int, default=5, help="steps per variant per round")
    p.add_argument("--width", type=int, default=None, help="model width (2048; 64 simulated)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (16; 4 simulated)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (1024; 32 simulated)")
    p.add_argument("--micro", type=int, default=2, help="samples per microbatch")
    p.add_argument("--json", dest="json_path", default=None, help="also write the figures here")
    args = p.parse_args()
    sim = args.simulate
    args.width = args.width or (64 if sim else 2048)
    args.heads = args.heads or (4 if sim else 16)
    args.seq = args.seq or (32 if sim else 1024)
    if not sim and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --simulate")

    from coordinator.demo import services
    from worker_client.gpu.nvml import REAL_NVML, SIMULATED_NVML
    from worker_client.gpu.nvml_readonly import register_read_only_module

    gpu = Gpu(cuda=not sim)
    device = torch.device("cuda" if gpu.cuda else "cpu")
    dtype = torch.float32 if sim else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp, services(None, lambda line: None) as url:
        os.environ.setdefault("PERSEUS_SIM_GPU_DIR", str(Path(tmp) / "gpu"))
        nvml_module = register_read_only_module(SIMULATED_NVML if sim else REAL_NVML)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        plan, high, low = _plan(nvml_module, Path(tmp))
        model = _model(args, device, dtype)
        shape = (args.micro, args.seq, args.width)
        data = (
            [torch.randn(shape, device=device, dtype=dtype) for _ in range(MICROBATCHES)],
            [torch.randn(shape, device=device, dtype=dtype) for _ in range(MICROBATCHES)],
        )
        from protocol.pipeline_schedules import stage_actions

        actions = stage_actions("1f1b", STAGES, MICROBATCHES, 0)
        hooks = {v: _hook(v, url, plan, nvml_module, gpu) for v in VARIANTS[2:]}
        sync_only = SyncOnly(gpu)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        syncs = {v: 0 for v in VARIANTS[1:]}
        requests = {v: 0 for v in hooks}
        started = time.perf_counter()
        for round_ in range(args.rounds):
            order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
            for v in order:
                hook = sync_only if v == "sync only" else hooks.get(v)
                s0 = hook.syncs if hook else 0
                r0 = _request_count(hook)
                block = [_step(model, hook, data, actions, gpu) for _ in range(args.block)]
                if round_ > 0:  # round 0 warms up
                    times[v] += block
                    if hook is not None:
                        syncs[v] += hook.syncs - s0
                        requests[v] = requests.get(v, 0) + _request_count(hook) - r0
        elapsed = time.perf_counter() - started
        lags = {v: _lags(h, model, data, actions, gpu) for v, h in hooks.items()}
        inst = {v: _instruction_ms(hooks[v]) for v in ("measure", "events")}
        sources = {v: type(h.energy_source).__name__ for v, h in hooks.items()}
        read_ms = _counter_read_ms(nvml_module)
        for h in hooks.values():
            h.close()
        dist.destroy_process_group()
    name = "simulated GPU, CPU torch" if sim else torch.cuda.get_device_name(0)
    _report(args, name, times, syncs, requests, lags, inst, sources, read_ms, elapsed, high, low)


def _request_count(hook: Callback | None) -> int:
    if not isinstance(hook, PerseusOptimizer):
        return 0
    if hook._clocks is not None:
        # clock_sync="events": the side thread may not have made the step's last requests yet
        # (a loaded machine); counted once it has, outside the timed steps.
        hook._clocks.flush()
    calls = hook.controller.calls  # type: ignore[attr-defined]
    return sum(1 for a, b in itertools.pairwise(calls) if a[1] != b[1])


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _report(args: Any, name: str, times: Any, syncs: Any, requests: Any, lags: Any, inst: Any,
            sources: Any, read_ms: float, elapsed: float, high: int, low: int) -> None:  # fmt: skip
    steps = len(times["bare"])
    bare = statistics.median(times["bare"])
    print(
        f"{name}: {args.layers} blocks, width {args.width}, {args.micro}x{args.seq} tokens per "
        f"microbatch, 1F1B stage 0 of {STAGES}, {MICROBATCHES} microbatches; plan F {high} MHz, "
        f"B {low} MHz (dry-run); {steps} measured steps per variant, alternating blocks of "
        f"{args.block}; {elapsed:.0f} s"
    )
    print(
        f"{'variant':<20}{'p50 ms':>9}{'p90 ms':>9}{'vs bare':>9}{'syncs/step':>12}"
        f"{'clock req/step':>16}{'lag p50 us':>12}{'lag p99 us':>12}  energy source"
    )
    figures: dict[str, Any] = {"gpu": name, "steps": steps, "variants": {}}
    for v, values in times.items():
        med = statistics.median(values)
        row = {"p50_ms": med * 1e3, "p90_ms": _pct(values, 0.9) * 1e3, "ratio": med / bare}
        line = f"{v:<20}{row['p50_ms']:>9.2f}{row['p90_ms']:>9.2f}{row['ratio']:>9.4f}"
        if v in syncs:
            row["syncs_per_step"] = syncs[v] / steps
        if v in lags:
            row |= {
                "requests_per_step": requests[v] / steps,
                "lag_p50_us": statistics.median(lags[v]),
                "lag_p99_us": _pct(lags[v], 0.99),
                "energy_source": sources[v],
            }
        if "syncs_per_step" in row:
            line += f"{row['syncs_per_step']:>12.1f}"
        if v in lags:
            line += (
                f"{row['requests_per_step']:>16.1f}"
                f"{row['lag_p50_us']:>12.1f}{row['lag_p99_us']:>12.1f}  {sources[v]}"
            )
        figures["variants"][v] = row
        print(line)
    print(f"energy counter read on the training thread: {read_ms:.3f} ms per read")
    for v, by_name in inst.items():
        text = ", ".join(f"{n} {ms:.3f} ms" for n, ms in sorted(by_name.items()))
        print(f"instruction times measured by {v}: {text}")
    figures |= {"counter_read_ms": read_ms, "instruction_ms": inst}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
