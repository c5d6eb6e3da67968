"""The blocking client: `Client`, `Episode`, `span_id`, and the module-level default client."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Dict, Iterator, Literal, Mapping, Optional, Type

from . import _validate as check
from ._errors import InvalidArgument, SidecarRejected, SidecarUnavailable, TaplineError

__all__ = [
    "DEFAULT_URL",
    "SPAN_ID_HEADER",
    "Client",
    "EndResult",
    "EndStatus",
    "Episode",
    "default_client",
    "episode",
    "set_default_client",
    "span_id",
    "start_episode",
]

#: Where the sidecar listens unless `TAPLINE_SIDECAR_URL` or `url` says otherwise.
DEFAULT_URL = "http://127.0.0.1:4100"
#: The response header in which the sidecar returns the span id of each proxied call.
SPAN_ID_HEADER = "x-tapline-span-id"

ENV_URL = "TAPLINE_SIDECAR_URL"
ENV_TOKEN = "TAPLINE_CONTROL_TOKEN"

#: How an episode can end.
EndStatus = Literal["succeeded", "failed", "timed_out", "aborted"]

logger = logging.getLogger("tapline")

_USER_AGENT = "tapline-python/0.1.0"
# How much of a non-JSON error body is quoted in an exception.
_QUOTE = 300


@dataclass(frozen=True)
class EndResult:
    """What the sidecar reported when an episode ended."""

    #: Calls attributed to the episode.
    calls: int
    #: Whether some of the episode's records had to be dropped (a full spool).
    incomplete: bool
    #: Always True: a sidecar refuses (404 `unknown_episode`) to end an episode it does
    #: not have open (one restarted on another spool directory). Kept for older
    #: sidecars.
    known: bool


class Client:
    """A client of one tapline sidecar's control API (blocking; thread-safe).

    - `url`: the sidecar; default `$TAPLINE_SIDECAR_URL`, else `http://127.0.0.1:4100`.
    - `token`: sent as `Authorization: Bearer <token>` (the sidecar's `--control-token`);
      default `$TAPLINE_CONTROL_TOKEN`, if set.
    - `fail_open`: when True (the default), an unreachable sidecar (or one answering 5xx)
      is logged as a warning on the `tapline` logger and the call returns normally, so
      that tapline never takes a harness down; when False, `SidecarUnavailable` is raised.
      A request the sidecar refuses with 4xx (a bug in the harness, or a wrong token) and
      an invalid argument raise in both modes.
    - `timeout`: seconds for each network operation of a request.

    Environment proxies (`HTTP_PROXY`, ...) are not used: the sidecar runs beside the
    harness.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        *,
        token: Optional[str] = None,
        fail_open: bool = True,
        timeout: float = 5.0,
    ) -> None:
        if url is None:
            url = os.environ.get(ENV_URL) or DEFAULT_URL
        parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise InvalidArgument(f"sidecar url must be an http:// or https:// URL, got {url!r}")
        if token is None:
            token = os.environ.get(ENV_TOKEN) or None
        elif not isinstance(token, str):
            raise InvalidArgument("token must be a string or None")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (math.isfinite(timeout) and timeout > 0):
            raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout!r}")
        url = url.rstrip("/")
        if parsed.path.rstrip("/").endswith("/v1"):
            # A common mix-up with the LLM clients' base URL (`<sidecar>/v1`).
            logger.warning("tapline: sidecar url %r ends with /v1; using %r (the control API is at the root)", url, url[:-3])
            url = url[:-3]
        self._url = url
        self._token = token or None
        self._fail_open = check.flag("fail_open", fail_open)
        self._timeout = float(timeout)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @property
    def url(self) -> str:
        """The sidecar's URL, without a trailing slash."""
        return self._url

    @property
    def fail_open(self) -> bool:
        """Whether an unreachable sidecar is logged and ignored rather than raised."""
        return self._fail_open

    @property
    def timeout(self) -> float:
        """Seconds for each network operation of a request."""
        return self._timeout

    def __repr__(self) -> str:
        return f"tapline.Client({self._url!r}, fail_open={self._fail_open}, token={'set' if self._token else None})"

    # -- episodes ----------------------------------------------------------------------

    def start_episode(
        self,
        task_id: str,
        *,
        group_id: Optional[str] = None,
        metadata: Optional[Mapping[str, Any]] = None,
        bind: bool = False,
        episode_id: Optional[str] = None,
    ) -> "Episode":
        """Starts an episode of `task_id` and returns it; end it with `Episode.end()` (or
        use `episode()`, which ends it for you).

        - `group_id`: episodes of one task with the same group id are compared with each
          other (e.g. the N samples of a GRPO group).
        - `metadata`: recorded with the episode's start; strings as they are, other JSON
          values as JSON text.
        - `bind`: also attribute calls made through the sidecar's plain base URL
          (`<url>/v1`) to this episode, for harnesses whose base URL is fixed. One episode
          is bound at a time; binding another replaces it.
        - `episode_id`: choose the id yourself (1 to 128 of `A-Z a-z 0-9 - _ .`); by
          default the sidecar picks a UUIDv7.

        Fail-open, when the sidecar is unreachable: a disabled episode (`id` None,
        `enabled` False) whose `base_url` is the sidecar's plain `<url>/v1`, so the
        harness's calls still go through the sidecar (unattributed) if it comes back.
        """
        body: Dict[str, Any] = {"task_id": check.task_id(task_id)}
        group = check.optional_text("group_id", group_id)
        if group is not None:
            body["group_id"] = group
        meta = check.metadata(metadata)
        if meta:
            body["metadata"] = meta
        if check.flag("bind", bind):
            body["bind"] = True
        chosen = check.optional_id("episode_id", episode_id)
        if chosen is not None:
            body["episode_id"] = chosen
        reply = self._post("episodes", body, what=f"start an episode of task {task_id!r}")
        if reply is None:
            return Episode(self, None, task_id=task_id, group_id=group, bound=False)
        eid = reply.get("episode_id")
        if not isinstance(eid, str) or not eid:
            return self._unexpected("episodes", f"no episode_id in {reply!r}", task_id, group)
        return Episode(self, eid, task_id=task_id, group_id=group, bound=bool(reply.get("bound", bind)))

    def episode(
        self,
        task_id: str,
        *,
        group_id: Optional[str] = None,
        metadata: Optional[Mapping[str, Any]] = None,
        bind: bool = False,
        episode_id: Optional[str] = None,
    ) -> "contextlib.AbstractContextManager[Episode]":
        """`with client.episode(task_id=...) as ep:` starts an episode on entry and ends it
        on exit: "succeeded" on a normal exit, "aborted" when an exception leaves the
        block (the exception propagates), nothing more if the block already ended it.
        Arguments as for `start_episode()`."""
        return self._episode_scope(task_id, group_id=group_id, metadata=metadata, bind=bind, episode_id=episode_id)

    @contextlib.contextmanager
    def _episode_scope(self, task_id: str, **options: Any) -> Iterator["Episode"]:
        ep = self.start_episode(task_id, **options)
        with ep:
            yield ep

    def health(self) -> Dict[str, Any]:
        """The sidecar's `/tapline/v1/health` document. Raises `SidecarUnavailable` when
        the sidecar cannot be reached, whatever `fail_open` says (it is a check)."""
        reply = self._request("GET", "health", None, what="check health", fail_open=False)
        assert reply is not None
        return reply

    # -- transport ---------------------------------------------------------------------

    def _unexpected(self, path: str, reason: str, task_id: str, group: Optional[str]) -> "Episode":
        err = SidecarUnavailable(f"{self._url}/tapline/v1/{path}", f"unexpected answer: {reason}")
        if not self._fail_open:
            raise err
        logger.warning("%s; continuing without recording (fail_open=True)", err)
        return Episode(self, None, task_id=task_id, group_id=group, bound=False)

    def _post(self, path: str, body: Dict[str, Any], *, what: str) -> Optional[Dict[str, Any]]:
        return self._request("POST", path, body, what=what, fail_open=self._fail_open)

    def _request(
        self, method: str, path: str, body: Optional[Dict[str, Any]], *, what: str, fail_open: bool
    ) -> Optional[Dict[str, Any]]:
        """Sends one control request. Returns the JSON answer, or None when the sidecar is
        unavailable (or answered 5xx) and `fail_open` is set."""
        url = f"{self._url}/tapline/v1/{path}"
        data = None if body is None else json.dumps(body, allow_nan=False, ensure_ascii=False).encode("utf-8")
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("User-Agent", _USER_AGENT)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self._token:
            req.add_header("Authorization", f"Bearer {self._token}")
        try:
            with self._opener.open(req, timeout=self._timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            try:
                raw = e.read()
            except (OSError, http.client.HTTPException):
                raw = b""
            finally:
                e.close()
            rejected = _rejection(e.code, raw)
            if e.code >= 500 and fail_open:
                logger.warning(
                    "tapline: could not %s: %s; continuing without recording (fail_open=True)", what, rejected
                )
                return None
            raise rejected from None
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            text = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
            self._unavailable(url, text, what, fail_open)
            return None
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            self._unavailable(url, f"the answer is not a JSON object: {raw[:_QUOTE]!r}", what, fail_open)
            return None
        return parsed

    def _unavailable(self, url: str, reason: str, what: str, fail_open: bool) -> None:
        err = SidecarUnavailable(url, reason)
        if not fail_open:
            raise err
        logger.warning("tapline: could not %s: %s; continuing without recording (fail_open=True)", what, err)


def _rejection(status: int, raw: bytes) -> SidecarRejected:
    code: Optional[str] = None
    message = raw[:_QUOTE].decode("utf-8", "replace") or http.client.responses.get(status, "")
    try:
        error = json.loads(raw)["error"]
        if isinstance(error.get("code"), str):
            code = error["code"]
        if isinstance(error.get("message"), str):
            message = error["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return SidecarRejected(status, code, message)


class Episode:
    """One episode on the sidecar. Made by `Client.start_episode()` / `Client.episode()`.

    Hand `base_url` to an OpenAI-style client and `anthropic_base_url` to an Anthropic
    client: every call through them is attributed to this episode. Use it as a context
    manager to end it automatically (see `Client.episode()`).
    """

    def __init__(
        self, client: Client, id: Optional[str], *, task_id: str, group_id: Optional[str], bound: bool
    ) -> None:
        self._client = client
        self._id = id
        self._task_id = task_id
        self._group_id = group_id
        self._bound = bound
        self._ended = False
        self._lock = threading.Lock()

    @property
    def id(self) -> Optional[str]:
        """The episode id; None for a disabled episode (fail-open, sidecar unreachable)."""
        return self._id

    @property
    def enabled(self) -> bool:
        """False when the sidecar was unreachable at the start (fail-open): nothing of
        this episode is recorded and `reward()`/`end()` send nothing."""
        return self._id is not None

    @property
    def task_id(self) -> str:
        return self._task_id

    @property
    def group_id(self) -> Optional[str]:
        return self._group_id

    @property
    def bound(self) -> bool:
        """Whether the sidecar bound this episode (calls on its plain URL count too)."""
        return self._bound

    @property
    def ended(self) -> bool:
        """Whether `end()` was called (and did not fail)."""
        return self._ended

    @property
    def base_url(self) -> str:
        """Base URL for OpenAI-style clients: `<sidecar url>/e/<id>/v1`, or the sidecar's
        plain `<sidecar url>/v1` for a disabled episode. Built from the client's URL, so
        scheme and path prefix are the ones the SDK reached the sidecar with."""
        if self._id is None:
            return f"{self._client.url}/v1"
        return f"{self._client.url}/e/{self._id}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """Base URL for Anthropic clients, which append `/v1/messages` themselves:
        `base_url` without its trailing `/v1`."""
        return self.base_url[: -len("/v1")]

    def __repr__(self) -> str:
        return f"tapline.Episode(id={self._id!r}, task_id={self._task_id!r}, group_id={self._group_id!r}, ended={self._ended})"

    def reward(
        self,
        value: float,
        *,
        name: Optional[str] = None,
        span_id: Optional[str] = None,
        tags: Optional[Mapping[str, str]] = None,
    ) -> Optional[str]:
        """Reports a reward; returns its id (None when nothing was recorded).

        - no `name`, no `span_id`: the episode's final scalar reward;
        - `name="tests_passed"`: a named reward component;
        - `span_id=tapline.span_id(raw_response)`: a reward for that one call.

        `value` must be a real, finite number: NaN, infinities, bools and non-numbers
        raise `ValueError` (`tapline.InvalidArgument`) before anything is sent. Report
        rewards before `end()`: the sidecar refuses a reward for an ended episode
        (`SidecarRejected`, status 409, code `episode_ended`) and writes nothing, so the
        trainer never meets a reward that arrived after it took the episode.
        """
        body = _reward_body(value, name=name, span_id=span_id, tags=tags)
        return self._send_reward(body)

    def _send_reward(self, body: Dict[str, Any]) -> Optional[str]:
        if self._id is None:
            logger.debug("tapline: episode disabled (sidecar unreachable); reward %r not sent", body)
            return None
        reply = self._client._post(f"episodes/{self._id}/rewards", body, what=f"report a reward of episode {self._id}")
        if reply is None:
            return None
        reward_id = reply.get("reward_id")
        return reward_id if isinstance(reward_id, str) else None

    def end(self, status: EndStatus = "succeeded", metadata: Optional[Mapping[str, Any]] = None) -> Optional[EndResult]:
        """Ends the episode with `status` (succeeded, failed, timed_out or aborted) and
        optional metadata. Returns what the sidecar reported, or None when nothing was
        recorded (disabled episode, or fail-open with the sidecar unreachable).

        Ending an episode twice raises `TaplineError`. When the request fails (fail-closed
        mode, or a rejection), the episode stays open and `end()` can be called again."""
        body: Dict[str, Any] = {"status": check.status(status)}
        meta = check.metadata(metadata)
        if meta:
            body["metadata"] = meta
        return self._send_end(body)

    def _send_end(self, body: Dict[str, Any]) -> Optional[EndResult]:
        with self._lock:
            if self._ended:
                raise TaplineError(f"episode {self._id} was already ended")
            if self._id is None:
                self._ended = True
                return None
            reply = self._client._post(f"episodes/{self._id}/end", body, what=f"end episode {self._id}")
            self._ended = True
        if reply is None:
            return None
        return EndResult(
            calls=int(reply.get("calls") or 0),
            incomplete=bool(reply.get("incomplete")),
            known=bool(reply.get("known", True)),
        )

    def __enter__(self) -> "Episode":
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if self._ended:
            return
        if exc_type is None:
            self.end("succeeded")
            return
        try:
            self.end("aborted", {"exception": exc_type.__name__})
        except TaplineError as e:
            # The block's own exception matters more; it propagates.
            logger.warning("tapline: could not end episode %s as aborted: %s", self._id, e)


def _reward_body(
    value: Any, *, name: Any = None, span_id: Any = None, tags: Any = None
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"value": check.reward_value(value)}
    checked_name = check.optional_text("name", name, allow_empty=False)
    if checked_name is not None:
        body["name"] = checked_name
    span = check.optional_id("span_id", span_id)
    if span is not None:
        body["span_id"] = span
    checked_tags = check.tags(tags)
    if checked_tags:
        body["tags"] = checked_tags
    return body


def span_id(response: Any) -> Optional[str]:
    """The span id the sidecar gave one proxied call: the `x-tapline-span-id` header of
    `response`, any object with `.headers` (an openai/anthropic raw response from
    `.with_raw_response`, an httpx/requests/urllib response) or a headers mapping itself.
    None when the header is absent (the call did not go through a sidecar)."""
    headers = getattr(response, "headers", response)
    if headers is None:
        return None
    getter = getattr(headers, "get", None)
    if getter is None:
        raise TypeError(f"span_id() needs a response with .headers or a headers mapping, got {type(response).__name__}")
    value = getter(SPAN_ID_HEADER)
    if value is None and isinstance(headers, Mapping):
        # A plain dict is case-sensitive; header names are not.
        for k, v in headers.items():
            if isinstance(k, str) and k.lower() == SPAN_ID_HEADER:
                value = v
                break
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value or None


# -- the module-level default client ----------------------------------------------------

_default: Optional[Client] = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The client of the module-level functions, made on first use from the environment
    (`TAPLINE_SIDECAR_URL`, `TAPLINE_CONTROL_TOKEN`), fail-open."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default


def set_default_client(client: Optional[Client]) -> None:
    """Replaces the client of the module-level functions (None: make a new one from the
    environment on next use)."""
    global _default
    if client is not None and not isinstance(client, Client):
        raise InvalidArgument(f"set_default_client() needs a tapline.Client, got {type(client).__name__}")
    with _default_lock:
        _default = client


def episode(
    task_id: str,
    *,
    group_id: Optional[str] = None,
    metadata: Optional[Mapping[str, Any]] = None,
    bind: bool = False,
    episode_id: Optional[str] = None,
) -> "contextlib.AbstractContextManager[Episode]":
    """`with tapline.episode(task_id=..., group_id=...) as ep:` on the default client;
    see `Client.episode()`."""
    return default_client().episode(task_id, group_id=group_id, metadata=metadata, bind=bind, episode_id=episode_id)


def start_episode(
    task_id: str,
    *,
    group_id: Optional[str] = None,
    metadata: Optional[Mapping[str, Any]] = None,
    bind: bool = False,
    episode_id: Optional[str] = None,
) -> Episode:
    """`Client.start_episode()` on the default client."""
    return default_client().start_episode(task_id, group_id=group_id, metadata=metadata, bind=bind, episode_id=episode_id)
