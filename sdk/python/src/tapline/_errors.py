"""The exceptions of the tapline SDK."""

from __future__ import annotations

from typing import Optional


class TaplineError(Exception):
    """Base class of every error the tapline SDK raises."""


class InvalidArgument(TaplineError, ValueError):
    """An argument cannot be sent (a NaN reward, an unknown status, an empty task id, ...).

    Raised before anything is sent, whatever `fail_open` says. It is a `ValueError` too.
    """


class SidecarUnavailable(TaplineError):
    """The sidecar could not be reached: connection refused, timeout, broken connection,
    or an answer that is not the control API's.

    Only raised by clients with `fail_open=False` (and by `Client.health()`); fail-open
    clients log a warning instead.
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"tapline sidecar at {url} is unavailable: {reason}")
        #: The URL that was requested.
        self.url = url
        #: What went wrong, in words.
        self.reason = reason


class SidecarRejected(TaplineError):
    """The sidecar answered with an error status (4xx, or 5xx in fail-closed mode).

    `status` is the HTTP status; `code` and `message` come from the sidecar's JSON error
    `{"error": {"message", "code"}}` (`code` is None when the answer had none).
    """

    def __init__(self, status: int, code: Optional[str], message: str) -> None:
        super().__init__(f"tapline sidecar refused the request ({status} {code or 'no code'}): {message}")
        #: The HTTP status.
        self.status = status
        #: The sidecar's error code, e.g. `invalid_value` or `unauthorized`.
        self.code = code
        #: The sidecar's explanation.
        self.message = message
