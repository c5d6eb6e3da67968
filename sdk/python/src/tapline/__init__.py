"""Report episodes and rewards from an agent harness to its tapline sidecar.

A harness keeps its own loop; tapline only needs to know where an episode starts and
ends and what it earned. Start an episode, hand its `base_url` to the LLM client (every
call through it is attributed to the episode), report rewards; the `with` block ends it::

    import openai, tapline

    with tapline.episode(task_id="task-42", group_id="batch-7") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key="unused")
        raw = llm.chat.completions.with_raw_response.create(model="m", messages=[...])
        ep.reward(0.5, span_id=tapline.span_id(raw))   # a reward for that one call
        ep.reward(1.0, name="tests_passed")            # a named reward component
        ep.reward(0.8)                                 # the final scalar reward
    # ended "succeeded"; "aborted" if an exception left the block

- The sidecar is `TAPLINE_SIDECAR_URL` (default `http://127.0.0.1:4100`), its control
  token `TAPLINE_CONTROL_TOKEN`; or make a `tapline.Client(url, token=...)`.
- Anthropic clients take `ep.anthropic_base_url` (the base URL without `/v1`).
- Fail-open (the default): an unreachable sidecar is logged as a warning on the
  `tapline` logger and the harness goes on (the episode is then disabled, `ep.id` is
  None, and `ep.base_url` is the sidecar's plain `/v1` URL). Invalid arguments (a NaN
  reward, an unknown status) and requests the sidecar refuses (4xx) still raise.
- `tapline.AsyncClient` offers the same API for asyncio (`async with client.episode(...)`).
"""

from ._async import AsyncClient, AsyncEpisode
from ._client import (
    DEFAULT_URL,
    SPAN_ID_HEADER,
    Client,
    EndResult,
    EndStatus,
    Episode,
    default_client,
    episode,
    set_default_client,
    span_id,
    start_episode,
)
from ._errors import InvalidArgument, SidecarRejected, SidecarUnavailable, TaplineError
from ._validate import END_STATUSES

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_URL",
    "END_STATUSES",
    "SPAN_ID_HEADER",
    "AsyncClient",
    "AsyncEpisode",
    "Client",
    "EndResult",
    "EndStatus",
    "Episode",
    "InvalidArgument",
    "SidecarRejected",
    "SidecarUnavailable",
    "TaplineError",
    "__version__",
    "default_client",
    "episode",
    "set_default_client",
    "span_id",
    "start_episode",
]
