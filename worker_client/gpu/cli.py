"""``perseus profile-p2p``: measure the GPU power while blocked on P2P communication.

Registered on the ``perseus`` command by the CLI module; on its own::

    python -c "from worker_client.gpu.cli import profile_p2p_command as c; c()" --help
"""

from __future__ import annotations

import contextlib
import csv
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click

from protocol.cli_types import FiniteFloatRange, OutputFile
from protocol.exceptions import ConfigError, PerseusError
from worker_client.gpu.p2p_power import P2PPowerResult, measure_p2p_power, parse_devices


def _devices(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, int]:
    try:
        return parse_devices(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command(
    "profile-p2p",
    epilog="Real GPUs are only read (no clock or power-limit change). Without a GPU, try "
    "--gpu simulated.",
)
@click.option(
    "--gpu",
    type=click.Choice(["nvml", "simulated"]),
    default="nvml",
    show_default=True,
    help="Measure a real GPU through NVML (read only) or the simulated GPU.",
)
@click.option(
    "--seconds",
    type=FiniteFloatRange(min=0, min_open=True, max=3600),
    default=2.0,
    show_default=True,
    help="How long the receiver blocks per repeat. Longer is more accurate: an H100's energy "
    "counter changes only about 10 times a second.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1, max=1000),
    default=3,
    show_default=True,
    help="Blocked intervals to measure.",
)
@click.option(
    "--devices",
    default="0,1",
    show_default=True,
    callback=_devices,
    help="NVML indices RECEIVER,SENDER. The receiver's GPU is measured; 0,0 on a one-GPU box.",
)
@click.option(
    "--csv",
    "csv_path",
    type=OutputFile(),
    default=None,
    help="Also write one row per repeat to this CSV file (its folder is checked first).",
)
@click.option(
    "--sample-interval",
    type=FiniteFloatRange(min=0.001, max=1.0),
    default=0.02,
    show_default=True,
    help="Seconds between the energy monitor's NVML reads.",
)
@click.option(
    "--sim-blocking-power",
    type=FiniteFloatRange(min=0, min_open=True),
    default=None,
    help="Blocking power of the simulated GPU, W (--gpu simulated only; default: its own).",
)
def profile_p2p_command(
    gpu: str,
    seconds: float,
    repeats: int,
    devices: tuple[int, int],
    csv_path: str | None,
    sample_interval: float,
    sim_blocking_power: float | None,
) -> None:
    """Measure the GPU's power while it is blocked on point-to-point communication.

    Two ranks (spawned processes, torch.distributed gloo): rank 1 sleeps SECONDS and sends,
    rank 0 blocks in recv meanwhile; the receiver's GPU energy over the blocked interval
    (energy monitor window) divided by its length is the blocking power. Prints each
    repeat, the mean, the spread, the monitor's error bound and the value for
    `perseus optimize --p2p-power`.

    The receiving GPU holds a CUDA context but runs nothing while it waits. Zeus's
    profile_p2p.py blocks in an NCCL recv instead, whose kernel keeps the GPU polling, as a
    pipeline on NCCL does while it waits; that state can draw more power than this one.
    """
    if sim_blocking_power is not None and gpu != "simulated":
        raise click.UsageError("--sim-blocking-power needs --gpu simulated")
    if sample_interval > seconds:
        raise click.BadParameter(
            f"{sample_interval} is longer than --seconds {seconds}", param_hint="--sample-interval"
        )
    with contextlib.ExitStack() as stack:
        if gpu == "simulated" and "PERSEUS_SIM_GPU_DIR" not in os.environ:
            # The simulated GPU's state lives in files; these go when the command ends.
            state = stack.enter_context(tempfile.TemporaryDirectory(prefix="perseus-sim-gpu-"))
            stack.enter_context(_environ("PERSEUS_SIM_GPU_DIR", state))
        try:
            result = measure_p2p_power(
                "simulated" if gpu == "simulated" else "nvml",
                seconds=seconds,
                repeats=repeats,
                devices=devices,
                sample_interval=sample_interval,
                sim_blocking_power_w=sim_blocking_power,
            )
        except PerseusError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(format_report(result))
    if csv_path is not None:
        try:
            write_csv(result, csv_path)
        except OSError as exc:
            raise click.ClickException(f"cannot write {csv_path}: {exc}") from None
        click.echo(f"wrote {csv_path}")


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """Set an environment variable (inherited by child processes) for the block."""
    os.environ[name] = value
    try:
        yield
    finally:
        del os.environ[name]


# --- output --------------------------------------------------------------------------------
CSV_COLUMNS = (
    "repeat",
    "gpu",
    "device",
    "seconds",
    "energy_j",
    "energy_error_bound_j",
    "watts",
    "watts_error_bound",
)


def write_csv(result: P2PPowerResult, path: str | Path) -> None:
    """Write one row per repeat (columns :data:`CSV_COLUMNS`)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for i, w in enumerate(result.windows, start=1):
            writer.writerow(
                [
                    i,
                    result.gpu,
                    result.receiver_device,
                    f"{w.seconds:.6f}",
                    f"{w.energy_j:.6f}",
                    f"{w.error_bound_j:.6f}",
                    f"{w.watts:.4f}",
                    f"{w.watts_error_bound:.4f}",
                ]
            )


def format_report(result: P2PPowerResult) -> str:
    """Human-readable report: per-repeat watts, mean, spread, error bound, optimizer flag."""
    kind = "real GPU, read only" if result.gpu == "nvml" else "simulated GPU"
    lines = [
        f"P2P blocking power of GPU {result.receiver_device} ({result.device_name}; {kind})",
        f"receiver blocked in a gloo recv from rank 1 (GPU {result.sender_device}), which waited "
        f"{result.requested_seconds:g} s before each send; energy from the {result.energy_source}",
        "",
        f"{'repeat':>6}  {'blocked_s':>9}  {'energy_J':>10}  {'bound_J':>8}  "
        f"{'watts':>8}  {'bound_W':>7}",
    ]
    for i, w in enumerate(result.windows, start=1):
        lines.append(
            f"{i:>6}  {w.seconds:>9.4f}  {w.energy_j:>10.3f}  {w.error_bound_j:>8.3f}  "
            f"{w.watts:>8.2f}  {w.watts_error_bound:>7.2f}"
        )
    low, high = result.range_w
    lines += [
        "",
        f"mean:        {result.mean_w:.2f} W over {len(result.windows)} repeat(s)",
        f"spread:      std {result.std_w:.2f} W, range {low:.2f} .. {high:.2f} W",
        f"error bound: +-{result.error_bound_w:.2f} W (energy monitor, mean of the repeats)",
    ]
    lines += [f"note:        {n}" for n in result.notes]
    lines += ["", f"pass to the optimizer: perseus optimize --p2p-power {result.p2p_power_arg}"]
    return "\n".join(lines)
