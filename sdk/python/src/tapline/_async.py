"""The asyncio client: the blocking client's requests run in a worker thread
(`asyncio.to_thread`), so the event loop never waits on the sidecar."""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Any, AsyncIterator, Dict, Mapping, Optional, Type

from . import _validate as check
from ._client import Client, EndResult, EndStatus, Episode, _reward_body, logger
from ._errors import TaplineError

__all__ = ["AsyncClient", "AsyncEpisode"]


class AsyncClient:
    """`Client` for asyncio code: the same arguments, settings and errors, and the same
    methods as coroutines. Arguments are checked before anything is sent, in the calling
    task; the requests themselves run in the default executor."""

    def __init__(
        self,
        url: Optional[str] = None,
        *,
        token: Optional[str] = None,
        fail_open: bool = True,
        timeout: float = 5.0,
    ) -> None:
        self._sync = Client(url, token=token, fail_open=fail_open, timeout=timeout)

    @property
    def url(self) -> str:
        """The sidecar's URL, without a trailing slash."""
        return self._sync.url

    @property
    def fail_open(self) -> bool:
        """Whether an unreachable sidecar is logged and ignored rather than raised."""
        return self._sync.fail_open

    @property
    def timeout(self) -> float:
        """Seconds for each network operation of a request."""
        return self._sync.timeout

    @property
    def sync_client(self) -> Client:
        """The blocking client underneath (same sidecar and settings)."""
        return self._sync

    def __repr__(self) -> str:
        return f"tapline.AsyncClient({self._sync.url!r}, fail_open={self._sync.fail_open})"

    async def start_episode(
        self,
        task_id: str,
        *,
        group_id: Optional[str] = None,
        metadata: Optional[Mapping[str, Any]] = None,
        bind: bool = False,
        episode_id: Optional[str] = None,
    ) -> "AsyncEpisode":
        """Starts an episode; see `Client.start_episode()`."""
        # Checked here, so that a bad argument raises before a thread is involved.
        check.task_id(task_id)
        check.optional_text("group_id", group_id)
        check.metadata(metadata)
        check.flag("bind", bind)
        check.optional_id("episode_id", episode_id)
        ep = await asyncio.to_thread(
            self._sync.start_episode, task_id, group_id=group_id, metadata=metadata, bind=bind, episode_id=episode_id
        )
        return AsyncEpisode(ep)

    def episode(
        self,
        task_id: str,
        *,
        group_id: Optional[str] = None,
        metadata: Optional[Mapping[str, Any]] = None,
        bind: bool = False,
        episode_id: Optional[str] = None,
    ) -> "contextlib.AbstractAsyncContextManager[AsyncEpisode]":
        """`async with client.episode(task_id=...) as ep:` starts an episode on entry and
        ends it on exit: "succeeded" on a normal exit, "aborted" when an exception
        (cancellation included) leaves the block, nothing more if the block ended it."""
        return self._episode_scope(task_id, group_id=group_id, metadata=metadata, bind=bind, episode_id=episode_id)

    @contextlib.asynccontextmanager
    async def _episode_scope(self, task_id: str, **options: Any) -> AsyncIterator["AsyncEpisode"]:
        ep = await self.start_episode(task_id, **options)
        async with ep:
            yield ep

    async def health(self) -> Dict[str, Any]:
        """The sidecar's health document; see `Client.health()`."""
        return await asyncio.to_thread(self._sync.health)


class AsyncEpisode:
    """`Episode` for asyncio code: the same properties; `reward()` and `end()` are
    coroutines; `async with` ends it like `with` ends an `Episode`."""

    def __init__(self, episode: Episode) -> None:
        self._ep = episode

    @property
    def sync_episode(self) -> Episode:
        """The blocking episode underneath."""
        return self._ep

    @property
    def id(self) -> Optional[str]:
        """The episode id; None for a disabled episode (fail-open, sidecar unreachable)."""
        return self._ep.id

    @property
    def enabled(self) -> bool:
        """False when the sidecar was unreachable at the start (fail-open)."""
        return self._ep.enabled

    @property
    def task_id(self) -> str:
        return self._ep.task_id

    @property
    def group_id(self) -> Optional[str]:
        return self._ep.group_id

    @property
    def bound(self) -> bool:
        return self._ep.bound

    @property
    def ended(self) -> bool:
        return self._ep.ended

    @property
    def base_url(self) -> str:
        """Base URL for OpenAI-style clients (`.../e/<id>/v1`)."""
        return self._ep.base_url

    @property
    def anthropic_base_url(self) -> str:
        """Base URL for Anthropic clients (`base_url` without the trailing `/v1`)."""
        return self._ep.anthropic_base_url

    def __repr__(self) -> str:
        return f"tapline.AsyncEpisode(id={self.id!r}, task_id={self.task_id!r}, ended={self.ended})"

    async def reward(
        self,
        value: float,
        *,
        name: Optional[str] = None,
        span_id: Optional[str] = None,
        tags: Optional[Mapping[str, str]] = None,
    ) -> Optional[str]:
        """Reports a reward; see `Episode.reward()`."""
        body = _reward_body(value, name=name, span_id=span_id, tags=tags)
        if not self._ep.enabled:
            return self._ep._send_reward(body)
        return await asyncio.to_thread(self._ep._send_reward, body)

    async def end(
        self, status: EndStatus = "succeeded", metadata: Optional[Mapping[str, Any]] = None
    ) -> Optional[EndResult]:
        """Ends the episode; see `Episode.end()`."""
        body: Dict[str, Any] = {"status": check.status(status)}
        meta = check.metadata(metadata)
        if meta:
            body["metadata"] = meta
        return await asyncio.to_thread(self._ep._send_end, body)

    async def __aenter__(self) -> "AsyncEpisode":
        return self

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if self._ep.ended:
            return
        if exc_type is None:
            await self.end("succeeded")
            return
        try:
            await self.end("aborted", {"exception": exc_type.__name__})
        except TaplineError as e:
            logger.warning("tapline: could not end episode %s as aborted: %s", self.id, e)
