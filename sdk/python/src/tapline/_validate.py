"""Checks run on every argument before anything is sent to the sidecar."""

from __future__ import annotations

import json
import math
import numbers
import re
from typing import Any, Dict, Mapping, Optional

from ._errors import InvalidArgument

#: The statuses an episode can end with.
END_STATUSES = ("succeeded", "failed", "timed_out", "aborted")

# What the sidecar accepts as an episode or span id: 1 to 128 of `A-Z a-z 0-9 - _ .`.
_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


def reward_value(value: Any) -> float:
    """`value` as a float, if it is a real, finite number (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"reward value must be a real number (int or float), got {type(value).__name__} {value!r}")
    try:
        as_float = float(value)
    except (OverflowError, ValueError, TypeError) as e:
        raise InvalidArgument(f"reward value {value!r} cannot be represented as a float: {e}") from None
    if not math.isfinite(as_float):
        raise InvalidArgument(f"reward value must be finite, got {as_float!r} (NaN and infinities are refused)")
    return as_float


def task_id(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"task_id must be a non-empty string, got {value!r}")
    return value


def optional_text(field: str, value: Any, *, allow_empty: bool = True) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument(f"{field} must be a string or None, got {type(value).__name__} {value!r}")
    if not allow_empty and not value:
        raise InvalidArgument(f"{field} must not be empty (pass None to leave it out)")
    return value


def optional_id(field: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise InvalidArgument(f"{field} must be 1 to 128 characters from A-Z a-z 0-9 - _ . , got {value!r}")
    return value


def status(value: Any) -> str:
    if not isinstance(value, str) or value not in END_STATUSES:
        raise InvalidArgument(f"status must be one of {', '.join(END_STATUSES)}; got {value!r}")
    return value


def metadata(value: Any) -> Optional[Dict[str, Any]]:
    """A mapping of string keys to JSON values (strings are recorded as they are, other
    values as JSON text)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"metadata must be a mapping of str to JSON values, got {type(value).__name__}")
    out: Dict[str, Any] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise InvalidArgument(f"metadata keys must be strings, got {k!r}")
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"metadata[{k!r}] is not a JSON value: {e}") from None
        out[k] = v
    return out


def tags(value: Any) -> Optional[Dict[str, str]]:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"tags must be a mapping of str to str, got {type(value).__name__}")
    out: Dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgument(f"tags must map strings to strings, got {k!r}: {v!r}")
        out[k] = v
    return out


def flag(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{field} must be True or False, got {value!r}")
    return value
