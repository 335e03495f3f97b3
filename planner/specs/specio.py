"""Strict reading of spec documents (model, hardware, plan, profile): one place for the checks.

Every value read from a user's file passes through these helpers so that a wrong type, an unknown
key, a negative size, NaN or an absurdly large number becomes one `PlannerError` line naming the
document, the key and the value, never a traceback deep inside the model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from planner.specs.errors import PlannerError

# Larger than any quantity a real spec holds (bytes, flop/s, params), small enough to stay exact.
MAX_MAGNITUDE = 1e30


def load_document(path: str | Path, what: str) -> dict[str, Any]:
    """Read a JSON (or YAML) file holding one object; errors name the path."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlannerError(f"cannot read {what} file {path}: {exc}") from None
    try:
        if path.suffix.lower() in {".yaml", ".yml"}:
            import yaml

            doc = yaml.safe_load(text)
        else:
            doc = json.loads(text, parse_constant=_reject_constant)
    except PlannerError:
        raise
    except Exception as exc:  # json/yaml parse errors of every flavour
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PlannerError(f"{what} file {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {first_line}") from None
    if not isinstance(doc, dict):
        raise PlannerError(f"{what} file {path} must hold an object, got {type(doc).__name__}")
    return doc


def write_json_atomic(path: str | Path, doc: Any, what: str) -> None:
    """Write `doc` as JSON, atomically (write_text_atomic)."""
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n", what)


def write_text_atomic(path: str | Path, text: str, what: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync it, then rename it into place:
    a crash mid-write never leaves a half-written document where a good one was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise PlannerError(f"cannot write {what} to {path}: {exc.strerror or exc}") from None


def _reject_constant(name: str) -> float:
    raise PlannerError(f"{name} is not a number; use a finite value")


def check_keys(doc: Mapping[str, Any], allowed: set[str], where: str) -> None:
    """Reject keys we do not know: a typo must not silently fall back to a default."""
    if not isinstance(doc, Mapping):
        raise PlannerError(f"{where} must be an object, got {type(doc).__name__}")
    unknown = sorted(repr(k) for k in doc if k not in allowed)
    if unknown:
        raise PlannerError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def renamed_keys(doc: Mapping[str, Any], old_names: Mapping[str, str], where: str) -> dict[str, Any]:
    """`doc` with each key of an old spelling (`old_names`: old -> new) under its new one; a document
    giving both spellings of one key is refused (which one would it mean?)."""
    if not isinstance(doc, Mapping):
        raise PlannerError(f"{where} must be an object, got {type(doc).__name__}")
    out = dict(doc)
    for old, new in old_names.items():
        if old in out:
            if new in out:
                raise PlannerError(f"{where}: give {new} or its old spelling {old}, not both")
            out[new] = out.pop(old)
    return out


def number(
    value: Any,
    where: str,
    *,
    minimum: float | None = None,
    exclusive_minimum: float | None = None,
    maximum: float = MAX_MAGNITUDE,
    integer: bool = False,
) -> float | int:
    """Validate one numeric value; bools, strings, NaN and infinities are refused."""
    # Fast path for the common case (the search validates thousands of candidate plans).
    if (
        type(value) is int
        and abs(value) <= maximum
        and (minimum is None or value >= minimum)
        and (exclusive_minimum is None or value > exclusive_minimum)
    ):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlannerError(f"{where} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise PlannerError(f"{where} must be finite, got {value!r}")
    if integer and isinstance(value, float):
        if not value.is_integer():
            raise PlannerError(f"{where} must be a whole number, got {value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise PlannerError(f"{where} must be at least {minimum:g}, got {value!r}")
    if exclusive_minimum is not None and value <= exclusive_minimum:
        raise PlannerError(f"{where} must be greater than {exclusive_minimum:g}, got {value!r}")
    if abs(value) > maximum:
        raise PlannerError(f"{where} is too large ({value!r}); at most {maximum:g}")
    return value


def string(value: Any, where: str, *, choices: tuple[str, ...] | None = None, max_len: int = 4096) -> str:
    if not isinstance(value, str):
        raise PlannerError(f"{where} must be a string, got {value!r}")
    if len(value) > max_len:
        raise PlannerError(f"{where} is longer than {max_len} characters")
    if choices is not None and value not in choices:
        raise PlannerError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
    return value
