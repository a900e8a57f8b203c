"""A workload's power-limit profile as Zeus's JSON profile file, and as a text table.

The file is Zeus's format, ``{"measurements": [{"power_limit": W, "energy": J, "time": s},
...]}``; perseus-mq adds ``optimal_power_limit``, ``selector`` and ``updated_at`` beside
``measurements``. Zeus ignores keys it does not know and so reads these files; this module
reads Zeus's (the added keys are optional, unknown keys are ignored like Zeus does). The Redis
store (:mod:`worker_client.power_limit.store`) keeps the same model
(:class:`protocol.models.PowerLimitProfile`), msgpack-encoded.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from protocol.exceptions import ConfigError, CoordinatorUnavailableError, ProtocolError
from protocol.json_text import DuplicateKeyError, loads_unique
from protocol.models import PowerLimitProfile
from worker_client.power_limit.store import implausible_limit

if TYPE_CHECKING:
    from worker_client.power_limit.store import PowerLimitProfileStore

logger = logging.getLogger(__name__)


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``measurements[2].energy: Input should be ... (got "1e3")``.

    A value of the wrong type is shown as JSON writes it (``true``, ``"250"``): "should be a
    valid integer" alone does not tell a user that the file holds a boolean.
    """
    lines = []
    for error in exc.errors():
        where = ""
        for part in error["loc"]:
            where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else part)
        got = error.get("input")
        shown = ""
        if error["type"].endswith("_type") and isinstance(got, (bool, int, float, str)):
            shown = f" (got {json.dumps(got)[:40]})"
        lines.append(f"{where or 'profile'}: {error['msg']}{shown}")
    return "; ".join(lines)


def _whole_number(value: object) -> object:
    """``300.0`` as ``300``; any other value as it is (strict validation judges it)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _whole_watts(data: dict[str, object]) -> dict[str, object]:
    """``data`` with limits written as integral floats (``300.0``) made integers.

    Zeus writes whole watts as JSON integers, but a hand-edited profile or another tool's may
    write ``300.0``: the same limit. ``300.5``, ``true`` and ``"300"`` stay as they are, for
    strict validation to refuse by name.
    """
    data = dict(data)
    if "optimal_power_limit" in data:
        data["optimal_power_limit"] = _whole_number(data["optimal_power_limit"])
    measurements = data.get("measurements")
    if isinstance(measurements, list):
        data["measurements"] = [
            {**m, "power_limit": _whole_number(m["power_limit"])}
            if isinstance(m, dict) and "power_limit" in m
            else m
            for m in measurements
        ]
    return data


def parse_profile(text: str | bytes, source: str) -> PowerLimitProfile:
    """Parse a JSON profile (Zeus's or perseus-mq's); ConfigError names ``source`` and the spot."""
    try:
        data = loads_unique(text)
    except DuplicateKeyError as exc:
        raise ConfigError(f"bad power-limit profile {source}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"bad power-limit profile {source}: not JSON (line {exc.lineno}, column "
            f"{exc.colno}: {exc.msg})"
        ) from None
    except RecursionError:  # thousands of nested brackets: json has no error of its own
        raise ConfigError(
            f"bad power-limit profile {source}: not JSON (nested too deeply)"
        ) from None
    except UnicodeDecodeError as exc:  # bytes that are no JSON encoding (e.g. a gzipped file)
        raise ConfigError(
            f"bad power-limit profile {source}: not JSON text (byte {exc.start}: {exc.reason})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"bad power-limit profile {source}: expected an object with 'measurements', "
            f"got {type(data).__name__}"
        )
    try:
        # Strict: a JSON true is no power limit (it was read as 1 W) and "250" no number.
        profile = PowerLimitProfile.model_validate(_whole_watts(data), strict=True)
    except ValidationError as exc:
        raise ConfigError(
            f"bad power-limit profile {source}: {describe_validation_error(exc)}"
        ) from None
    why = implausible_limit(profile)
    if why is not None:  # 300000 was taken as 300 kW, and imported as such
        raise ConfigError(f"bad power-limit profile {source}: {why}")
    return profile


def load_profile_file(path: str | Path) -> PowerLimitProfile:
    """Read a profile file written by Zeus or by perseus-mq.

    Raises:
        ConfigError: The file cannot be read, is not JSON, or a field is invalid (the message
            names the file and the field, e.g. ``measurements[1].time``).

    """
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read power-limit profile {path}: {exc}") from None
    return parse_profile(text, str(path))


def load_profile(
    path: Path | None, store: PowerLimitProfileStore | None, workload: str | None
) -> PowerLimitProfile | None:
    """The profile in the file at ``path`` if there is one, else ``workload``'s in ``store``.

    Redis only saves profiling time: an unreachable store, or an entry that cannot be read
    (every rank reads the same one, so all profile again and replace it), is a warning and
    no profile.

    Raises:
        ConfigError: The file exists but is no profile (its error names the file and field).
    """
    if path is not None and path.exists():
        return load_profile_file(path)
    if store is not None and workload is not None:
        try:
            return store.load(workload)
        except CoordinatorUnavailableError as exc:
            logger.warning("cannot load the stored power-limit profile: %s", exc)
        except ProtocolError as exc:
            logger.warning("%s; profiling again (the new profile replaces it)", exc)
    return None


def describe_reuse(profile: PowerLimitProfile, optimal_mw: int, selector: object) -> str:
    """The log line of a run that takes its limit from a stored profile.

    The selector of this run chooses from the stored measurements; where the limit stored
    with them (chosen by another selector) differs, the line says so.
    """
    line = (
        f"using a stored power-limit profile: {optimal_mw / 1000:g} W, chosen now by {selector!r}"
    )
    stored = profile.optimal_power_limit
    if stored is not None and stored != optimal_mw // 1000:
        line += f" (stored with it: {stored} W, chosen by {profile.selector or 'another selector'})"
    return line


def save_profile_file(
    profile: PowerLimitProfile, path: str | Path, make_folders: bool = True
) -> None:
    """Write ``profile`` in Zeus's layout plus perseus-mq's keys, atomically.

    Ranks sharing a path never see half a file (temporary file + rename). The file gets the
    permissions any new file gets under the umask (e.g. 0644), as Zeus's ``open()`` gives it:
    another user (``perseus power-limit show --file``, a Zeus run) can read what root wrote.

    Args:
        profile: What to write.
        path: The file.
        make_folders: Make missing folders above ``path`` (a rank, at the end of its
            profiling, rather than lose the measurements); a command refuses them, as ``cp``
            does a mistyped folder.

    Raises:
        OSError: The file cannot be written; its ``filename`` is ``path``, not the hidden
            temporary file that failed.
    """
    target = Path(path)
    if make_folders:
        target.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "measurements": [m.model_dump() for m in profile.measurements],
        "optimal_power_limit": profile.optimal_power_limit,
        "selector": profile.selector,
        "updated_at": profile.updated_at,
    }
    # Not mkstemp: its files are 0600 whatever the umask. A name of this process's own.
    tmp = str(target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    except OSError as exc:  # it named the temporary file, which the user never heard of
        raise OSError(exc.errno, exc.strerror, str(target)) from None
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(document, out, indent=4)  # Zeus indents its files by 4 too
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(target)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_or_warn(
    profile: PowerLimitProfile,
    path: str | Path | None,
    store: PowerLimitProfileStore | None = None,
    workload: str | None = None,
) -> None:
    """:func:`save_profile_file` to ``path`` and ``store``'s entry for ``workload`` (those given).

    For the optimizer, once profiling ends: a file that cannot be written or a store that is
    unreachable is a warning. They only save the next run's profiling, so a full disk or a
    read-only mount must not end the training that goes on at the optimum.
    """
    if path is not None:
        try:
            save_profile_file(profile, path)
        except OSError as exc:
            logger.warning(
                "cannot write the power-limit profile %s: %s; training goes on (a next run "
                "given this profile_path profiles again)",
                path,
                exc,
            )
    if store is not None and workload is not None:
        try:
            store.save(workload, profile)
        except CoordinatorUnavailableError as exc:
            logger.warning("cannot store the power-limit profile: %s", exc)


def format_time(unix: float) -> str:
    """``2026-11-23 10:00:00 UTC``, or ``?`` for an unknown time (0).

    A time datetime cannot show (an index score written before ``updated_at`` had a bound)
    reads ``1e+300 (out of range)``, not a traceback that ends the whole listing.
    """
    if not unix:
        return "?"
    try:
        when = datetime.fromtimestamp(unix, tz=timezone.utc)
    except (OverflowError, OSError, ValueError):
        return f"{unix:g} (out of range)"
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, a dashed line under the header."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_profile(name: str, profile: PowerLimitProfile) -> str:
    """The profile as ``perseus power-limit show WORKLOAD`` prints it (* marks the chosen limit)."""
    optimal = profile.optimal_power_limit
    chosen = (
        "no limit chosen (the optimizer's selector picks one)"
        if optimal is None
        else f"optimal {optimal} W, chosen by {profile.selector or '?'}"
    )
    head = f"{name}: {chosen}, updated {format_time(profile.updated_at)}"
    rows = [
        [
            ("* " if m.power_limit == optimal else "  ") + str(m.power_limit),
            f"{m.time:.3f}",
            f"{m.energy:.1f}",
            f"{m.energy / m.time:.1f}" if m.time > 0 else "-",
        ]
        for m in profile.measurements
    ]
    table = format_table(["  limit (W)", "time (s)", "energy (J)", "avg power (W)"], rows)
    return f"{head}\n{table}"
