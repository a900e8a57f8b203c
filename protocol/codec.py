"""The msgpack codec of every model that crosses Redis: pack, unpack, validate, name bad fields.

Generic over pydantic models (the models themselves are in :mod:`protocol.models`, which
re-exports these functions); the stream messages' encoding is there, next to their union.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from protocol.exceptions import ProtocolError

M = TypeVar("M", bound=BaseModel)


def pack(model: BaseModel) -> bytes:
    """Encode a model as compact msgpack."""
    return msgpack.packb(model.model_dump(mode="python"), use_bin_type=True)


def pack_rank_reply(job_id: str, instruction_energy: bool, token: str) -> bytes:
    """``pack(Reply(ok=True, ...))`` of a rank's registration, without building the model.

    The same bytes (a test checks): the rank waits for this reply, and building and dumping
    the model costs more than the rest of packing it.

    Args:
        job_id: The job the rank joined.
        instruction_energy: Whether the job's scheduler needs per-instruction energy.
        token: The rank's new token.

    Returns:
        The msgpack reply.
    """
    reply = {
        "ok": True,
        "job_id": job_id,
        "error": "",
        "instruction_energy": instruction_energy,
        "token": token,
    }
    return msgpack.packb(reply, use_bin_type=True)


def pack_plain(model: BaseModel) -> bytes:
    """``pack(model)`` of a model whose fields hold only numbers, strings, lists and dicts.

    Such a model's ``__dict__`` is what ``model_dump`` returns; skipping the dump matters on
    the paths a rank waits on (a test checks that the bytes are the same).

    Args:
        model: A :class:`RankInfo` or :class:`ProfilingResult`, say (no nested models).

    Returns:
        What ``pack(model)`` returns.
    """
    return msgpack.packb(dict(model.__dict__), use_bin_type=True)


# What msgpack's errors that carry no message mean.
_SILENT_ERRORS = {
    "StackError": "nested too deeply",
    "FormatError": "a byte that starts no msgpack value (0xc1)",
}


def unpack_raw(data: bytes) -> Any:
    """Decode msgpack ``data`` without validating it; raise ProtocolError naming what is wrong."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        # StackError and FormatError say nothing by themselves.
        detail = str(exc) or _SILENT_ERRORS.get(type(exc).__name__, "no detail")
        raise ProtocolError(f"not valid msgpack ({type(exc).__name__}: {detail})") from None


def validation_text(exc: ValidationError) -> str:
    """One line naming each field that is wrong: ``iteration_time: Input should be ...``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        # pydantic's prefix for a validator's ValueError; such a check of several fields
        # (loc empty) names them itself.
        msg = err["msg"].removeprefix("Value error, ")
        if not loc and err["type"] == "value_error":
            parts.append(msg)
        else:
            parts.append(f"{loc or '<root>'}: {msg}")
    return "; ".join(parts)


def unpack(cls: type[M], data: bytes) -> M:
    """Decode and validate msgpack ``data`` as ``cls``; raise ProtocolError naming the field."""
    return validate(cls, unpack_raw(data))


def validate(cls: type[M], raw: Any) -> M:
    """Validate decoded data as ``cls``; raise ProtocolError naming the field."""
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise ProtocolError(f"invalid {cls.__name__}: {validation_text(exc)}") from None
