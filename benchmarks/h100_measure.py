#!/usr/bin/env python
"""Measure, read only, what Perseus's profiler relies on, on one GPU (meant for a lent H100).

Nothing on the GPU is changed: NVML is reached only through ``ReadOnlyNVML`` (whose module
proxy refuses every NVML write), and the clock Perseus's profiler would set first is handed
to a ``DryRunFrequencyController``, which only records it. The workload runs at the card's
current clock.

What it measures and prints (every figure comes from this run):

* the supported clocks (count, min, max) and the current clock;
* the energy counter: cost of one ``nvmlDeviceGetTotalEnergyConsumption`` read (ms/call) and
  its update period (time between value changes, polled back to back);
* a small transformer-like MLP training step (``--layers`` blocks of LayerNorm, Linear, GELU,
  Linear with a residual) with a batch sized so that one forward takes about
  ``--target-ms``: forward and backward time (CUDA-synchronized per call) and energy per
  instruction from one long ``EnergyMonitor`` window over ``--reps`` back-to-back calls,
  with the monitor's error bound;
* long-window energy vs. mean sampled power x time;
* single-instruction windows (one forward each) against the long-window figure: their spread,
  their error vs. the long window, their bounds, and how many read 0 J from the raw counter.

``--simulate`` runs the same code against the simulated GPU (``worker_client.simulated.gpu``)
and CPU torch. The simulated counter grows only when energy is accounted, so a side thread
accounts ``--sim-power`` watts every ``--sim-update-period`` seconds (the period a real
counter updates at), so that the script itself can be tested without a GPU.

Without CUDA or NVML (and no ``--simulate``) it prints why and exits with status 0, or 1 with
``--require-gpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if "CUDA_VISIBLE_DEVICES" not in os.environ:
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA ordinal = NVML index

from benchmarks.h100_probes import (  # noqa: E402
    PowerPoller,
    build_model,
    calibrate_batch,
    compare_singles,
    counter_read_cost,
    counter_update_period,
    long_window,
    single_windows,
    stats,
    timed,
)
from protocol.exceptions import GPUError  # noqa: E402
from worker_client.gpu.energy import EnergyMonitor  # noqa: E402
from worker_client.gpu.frequency import DryRunFrequencyController  # noqa: E402
from worker_client.gpu.nvml import REAL_NVML  # noqa: E402
from worker_client.gpu.nvml_readonly import ReadOnlyNVML, assert_read_only  # noqa: E402
from worker_client.gpu.p2p_power import cuda_ordinal  # noqa: E402
from worker_client.simulated.gpu import SimulatedSteadyPower  # noqa: E402

SIM_MODULE = "worker_client.simulated.gpu"


# --- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simulate", action="store_true", help="simulated GPU + CPU torch")
    p.add_argument("--device", type=int, default=0, help="NVML index of the GPU")
    p.add_argument("--reps", type=int, default=100, help="calls per long window")
    p.add_argument("--singles", type=int, default=30, help="single-instruction windows")
    p.add_argument("--width", type=int, default=None, help="model width (4096; 256 simulated)")
    p.add_argument("--layers", type=int, default=None, help="blocks (4; 2 simulated)")
    p.add_argument("--batch", type=int, default=None, help="rows per batch (default: calibrate)")
    p.add_argument(
        "--max-batch", type=int, default=None, help="calibration cap (32768; 4096 simulated)"
    )
    p.add_argument(
        "--target-ms", type=float, default=None, help="forward time to aim at (20; 10 simulated)"
    )
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--sample-interval", type=float, default=0.01, help="monitor sampler period, s")
    p.add_argument("--counter-calls", type=int, default=200, help="reads to time the counter")
    p.add_argument("--probe-seconds", type=float, default=2.0, help="counter update probe length")
    p.add_argument("--sim-power", type=float, default=300.0, help="--simulate: GPU power, W")
    p.add_argument(
        "--sim-update-period", type=float, default=0.1, help="--simulate: counter period, s"
    )
    p.add_argument("--json", dest="json_path", default=None, help="also write the figures here")
    p.add_argument("--require-gpu", action="store_true", help="exit 1 (not 0) without CUDA/NVML")
    args = p.parse_args(argv)
    sim = args.simulate
    for name, real, simulated in (
        ("width", 4096, 256),
        ("layers", 4, 2),
        ("max_batch", 32768, 4096),
        ("target_ms", 20.0, 10.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, simulated if sim else real)
    if args.dtype is None:
        args.dtype = "float32" if sim else "bfloat16"
    if min(args.reps, args.singles, args.width, args.layers, args.counter_calls) < 1:
        p.error("--reps, --singles, --width, --layers and --counter-calls must be >= 1")
    if args.sample_interval <= 0 or args.probe_seconds <= 0 or args.target_ms <= 0:
        p.error("--sample-interval, --probe-seconds and --target-ms must be positive")
    return args


def skip(message: str, args: argparse.Namespace) -> int:
    print(f"h100_measure: nothing measured: {message}")
    print("h100_measure: run with --simulate to smoke-test the script without a GPU")
    return 1 if args.require_gpu else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"simulated": args.simulate}
    source: SimulatedSteadyPower | None = None
    own_dir: str | None = None
    if args.simulate:
        if not os.environ.get("PERSEUS_SIM_GPU_DIR"):
            own_dir = os.environ["PERSEUS_SIM_GPU_DIR"] = tempfile.mkdtemp(prefix="perseus-sim-")
        module = SIM_MODULE
    else:
        module = REAL_NVML
    try:
        nvml = ReadOnlyNVML(module)
    except GPUError as exc:
        return skip(f"no NVML ({exc})", args)
    assert_read_only(nvml)
    idx = args.device
    if not 0 <= idx < nvml.device_count():
        return skip(f"no GPU {idx} (NVML sees {nvml.device_count()})", args)
    if args.simulate:
        source = SimulatedSteadyPower(idx, args.sim_power, args.sim_update_period)
        source.start()
    try:
        return run(args, nvml, idx, report)
    finally:
        if source is not None:
            source.stop()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(report, indent=1))


def run(args: argparse.Namespace, nvml: ReadOnlyNVML, idx: int, report: dict[str, Any]) -> int:
    clock_before = nvml.clock_mhz(idx)
    clocks = nvml.graphics_clocks(idx)
    mem_clocks = nvml.memory_clocks(idx)
    print("== device ==")
    print(f"GPU {idx}: {nvml.name(idx)}; {'simulated' if args.simulate else 'real, read only'}")
    print("== clocks ==")
    print(
        f"graphics clocks: {len(clocks)} supported, min {min(clocks)} MHz, "
        f"max {max(clocks)} MHz; current {clock_before} MHz"
    )
    print(f"memory clocks: {mem_clocks}; current {nvml.clock_mhz(idx, memory=True)} MHz")
    dry = DryRunFrequencyController(idx)  # records only; given the clocks read above
    dry.memory_clock, dry.graphics_clocks = mem_clocks[0], clocks
    dry.set_frequency(dry.graphics_clocks[0])  # a profiling sweep starts at the max clock
    print(
        f"dry run: Perseus would lock {dry.records[-1][1]} MHz first "
        f"(memory {dry.memory_clock} MHz); recorded only, not applied"
    )
    report["clocks"] = {
        "count": len(clocks),
        "min": min(clocks),
        "max": max(clocks),
        "current": clock_before,
        "memory": mem_clocks,
        "dry_run_requests": [f for _, f in dry.records],
    }
    dry.stop()

    print("== energy counter ==")
    if nvml.total_energy_mj(idx) is None:
        print("this GPU has no energy counter: the monitor polls power instead")
        report["counter"] = None
    else:
        c = counter_read_cost(nvml, idx, args.counter_calls)
        print(
            f"read cost: {c['median_ms']:.3f} ms/call median, {c['mean_ms']:.3f} mean, "
            f"{c['max_ms']:.3f} max over {args.counter_calls} calls"
        )
        u = counter_update_period(nvml, idx, args.probe_seconds)
        if "period_median_ms" in u:
            print(
                f"update period: {u['period_median_ms']:.1f} ms median "
                f"({u['period_min_ms']:.1f}..{u['period_max_ms']:.1f}), "
                f"{u['updates_per_s']:.1f} updates/s; {u['changes']:.0f} changes in "
                f"{u['reads']:.0f} reads over {args.probe_seconds:g} s"
            )
        else:
            print(
                f"update period: < 2 changes in {args.probe_seconds:g} s ({u['reads']:.0f} reads)"
            )
        report["counter"] = {"read_cost": c, "update": u}

    import torch

    print("== workload ==")
    if args.simulate:
        device = "cpu"
    elif not torch.cuda.is_available():
        print("skipped: torch sees no CUDA here (the NVML figures above stand)")
        return 1 if args.require_gpu else 0
    else:
        ordinal = cuda_ordinal(idx)
        if ordinal is None:
            print("skipped: CUDA_VISIBLE_DEVICES hides this GPU from CUDA")
            return 1 if args.require_gpu else 0
        device = f"cuda:{ordinal}"
        torch.cuda.set_device(ordinal)
    measure_workload(args, nvml, idx, device, report)
    clock_after = nvml.clock_mhz(idx)
    print("== read-only check ==")
    assert_read_only(nvml)
    print(
        f"NVML writes unreachable (ReadOnlyNVML). Current clock {clock_before} MHz before, "
        f"{clock_after} MHz after (never set here; the driver moves it under load)"
    )
    report["clock_after"] = clock_after
    return 0


def measure_workload(
    args: argparse.Namespace, nvml: ReadOnlyNVML, idx: int, device: str, report: dict[str, Any]
) -> None:
    import torch

    dtype = getattr(torch, args.dtype)
    model = build_model(args, device, dtype)
    is_cuda = device.startswith("cuda")

    def sync() -> None:
        if is_cuda:
            torch.cuda.synchronize()

    timed(lambda: model(torch.randn(64, args.width, device=device, dtype=dtype)), sync, 3)
    batch = calibrate_batch(model, args, device, dtype, sync)
    x = torch.randn(batch, args.width, device=device, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"MLP: {args.layers} blocks, width {args.width}, {params / 1e6:.1f} M parameters, "
        f"{args.dtype}, batch {batch} rows, on {device}"
    )
    loss = model(x).float().pow(2).mean()

    def forward() -> Any:
        return model(x)

    def backward() -> None:
        loss.backward(retain_graph=True)  # the same backward each call

    timed(forward, sync, 3)
    timed(backward, sync, 3)
    times = {"forward": timed(forward, sync, args.singles)}
    times["backward"] = timed(backward, sync, args.singles)
    report["workload"] = {"batch": batch, "parameters": params, "dtype": args.dtype}
    report["workload"].update({f"{k}_time_s": stats(v) for k, v in times.items()})

    monitor = EnergyMonitor(
        [idx], nvml=nvml, sample_interval=args.sample_interval, index_space="nvml"
    )
    poller = PowerPoller(nvml, idx, max(args.sample_interval, 0.01))
    try:
        mode = monitor.modes[idx]
        long = {
            "forward": long_window(monitor, poller, idx, forward, args.reps, "forward"),
            "backward": long_window(monitor, poller, idx, backward, args.reps, "backward"),
        }
        singles = single_windows(monitor, idx, forward, args.singles)
    finally:
        monitor.close()
    raw = EnergyMonitor(  # the raw counter staircase, as a naive reader sees it
        [idx],
        nvml=nvml,
        sample_interval=args.sample_interval,
        approx_instant_energy=False,
        index_space="nvml",
    )
    try:
        raw_singles = single_windows(raw, idx, forward, args.singles)
    finally:
        raw.close()

    print("== per-instruction time and energy ==")
    print(f"energy source: {mode}; sampler every {args.sample_interval * 1000:g} ms")
    for name, lw in long.items():
        s = stats(times[name])
        print(
            f"{name}: time {s['mean'] * 1000:.3f} ms (std {s['std'] * 1000:.3f}, n {s['n']:.0f}, "
            f"synchronized per call); {lw['time_per_call_s'] * 1000:.3f} ms in the "
            f"{lw['reps']}-call window"
        )
        print(
            f"{name}: energy {lw['energy_per_call_j']:.4f} J +- {lw['bound_per_call_j']:.4f} J "
            f"per call ({lw['energy_j']:.2f} J +- {lw['bound_j']:.2f} J in {lw['window_s']:.3f} s)"
        )
    print("== monitor vs power x time ==")
    for name, lw in long.items():
        diff = lw["energy_j"] - lw["power_x_time_j"]
        rel = diff / lw["energy_j"] if lw["energy_j"] > 0 else float("nan")
        print(
            f"{name} window: monitor {lw['energy_j']:.2f} J +- {lw['bound_j']:.2f}; mean power "
            f"{lw['mean_power_w']:.1f} W ({lw['power_samples']} samples) x {lw['window_s']:.3f} s "
            f"= {lw['power_x_time_j']:.2f} J; difference {diff:+.2f} J ({rel:+.1%})"
        )
    print("== single-instruction windows vs long windows ==")
    fwd = long["forward"]
    power = fwd["energy_j"] / fwd["window_s"]
    rel_bound = fwd["bound_j"] / fwd["energy_j"] if fwd["energy_j"] > 0 else float("nan")
    print(
        f"long window ({args.reps} forwards): {fwd['energy_per_call_j']:.4f} J per forward, "
        f"{power:.1f} W, bound {rel_bound:.2%} of the energy"
    )
    report.update(mode=mode, long_windows=long, long_relative_bound=rel_bound)
    for label, windows in (("interpolated", singles), ("raw counter", raw_singles)):
        c = compare_singles(windows, power)
        print(
            f"{label}: {c['windows']} one-forward windows of {c['mean_time_s'] * 1000:.2f} ms, "
            f"mean {c['mean_j']:.4f} J (spread {c['rel_std']:.1%}); vs long-window power x "
            f"length: error {c['mean_rel_error']:.1%} mean, {c['max_rel_error']:.1%} max; "
            f"bound {c['mean_rel_bound']:.1%}; {c['zero_readings']} read 0 J"
        )
        report[f"singles_{label.replace(' ', '_')}"] = c


if __name__ == "__main__":
    sys.exit(main())
