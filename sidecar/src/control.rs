//! The control API under `/tapline/v1/`, used by the SDKs: create an episode (optionally
//! bound to this sidecar), add a reward, end an episode, health. Each write becomes a
//! record. Errors are 4xx with `{"error": {"message", "code"}}`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tapline_proto::{EndStatus, EpisodeEvent, EpisodeEventKind, RecordKind, Reward};

use crate::body::{RespBody, full_body};
use crate::clock::now_nanos;
use crate::episodes::{EPISODE_ID_RULE, EpisodeInfo, NotOpen, valid_episode_id};
use crate::state::AppState;

/// Largest control request body accepted.
const MAX_BODY: usize = 1 << 20;

fn reply(status: StatusCode, body: Value) -> Response<RespBody> {
    let mut resp = Response::new(full_body(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// A refused control request: its status, and the `code` and `message` of the JSON
/// error body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status (4xx, or 503 when a record could not be queued).
    pub status: StatusCode,
    /// Machine-readable code, e.g. `invalid_value`.
    pub code: &'static str,
    /// What is wrong and what to do.
    pub message: String,
}

fn err(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        status,
        code,
        message: message.into(),
    }
}

/// Handles a request whose path starts with `/tapline/`.
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Response<RespBody> {
    state
        .metrics
        .control_requests
        .fetch_add(1, Ordering::Relaxed);
    match route(&state, req).await {
        Ok(resp) => resp,
        Err(e) => {
            state.metrics.control_errors.fetch_add(1, Ordering::Relaxed);
            reply(
                e.status,
                json!({"error": {"message": e.message, "code": e.code}}),
            )
        }
    }
}

async fn route(
    state: &Arc<AppState>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, ApiError> {
    let endpoint = endpoint(req.method(), req.uri().path())?;
    if endpoint != Endpoint::Health {
        authorize(state, &req)?;
    }
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| state.config.listen.to_string());
    let body = match endpoint {
        Endpoint::Health => Bytes::new(),
        _ => read_body(req).await?,
    };
    match parse(endpoint, &body)? {
        ControlRequest::Health => Ok(health(state)),
        ControlRequest::CreateEpisode(new) => create_episode(state, &host, new).await,
        ControlRequest::AddReward(reward) => add_reward(state, reward).await,
        ControlRequest::EndEpisode(end) => end_episode(state, end).await,
    }
}

/// A control endpoint, with the episode id of the path (validated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `GET /tapline/v1/health`.
    Health,
    /// `POST /tapline/v1/episodes`.
    CreateEpisode,
    /// `POST /tapline/v1/episodes/{id}/rewards`.
    AddReward(String),
    /// `POST /tapline/v1/episodes/{id}/end`.
    EndEpisode(String),
}

/// Which endpoint a method and path name, or the 400/404/405 that answers them.
pub fn endpoint(method: &Method, path: &str) -> Result<Endpoint, ApiError> {
    let path = path.trim_end_matches('/');
    let Some(rest) = path.strip_prefix("/tapline/v1") else {
        return Err(err(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no control endpoint {path}; the API lives under /tapline/v1/"),
        ));
    };
    let parts: Vec<&str> = rest.split('/').filter(|p| !p.is_empty()).collect();
    match (method, parts.as_slice()) {
        (&Method::GET, ["health"]) => Ok(Endpoint::Health),
        (&Method::POST, ["episodes"]) => Ok(Endpoint::CreateEpisode),
        (&Method::POST, ["episodes", id, "rewards"]) => Ok(Endpoint::AddReward(episode_id(id)?)),
        (&Method::POST, ["episodes", id, "end"]) => Ok(Endpoint::EndEpisode(episode_id(id)?)),
        (_, ["health"] | ["episodes"] | ["episodes", _, "rewards" | "end"]) => Err(err(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("{method} is not allowed on {path}"),
        )),
        _ => Err(err(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no control endpoint {path}"),
        )),
    }
}

/// A control request, parsed and checked: what is left to do needs the sidecar's state.
#[derive(Debug, Clone, PartialEq)]
pub enum ControlRequest {
    /// Report health.
    Health,
    /// Create an episode.
    CreateEpisode(NewEpisode),
    /// Add a reward to an episode.
    AddReward(NewReward),
    /// End an episode.
    EndEpisode(EpisodeEnd),
}

/// Parses and checks the body of a request to `endpoint` (an empty body reads as `{}`).
/// Pure: the same bytes always give the same answer, which is what the fuzzer checks.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ControlRequest, ApiError> {
    Ok(match endpoint {
        Endpoint::Health => ControlRequest::Health,
        Endpoint::CreateEpisode => ControlRequest::CreateEpisode(new_episode(from_json(body)?)?),
        Endpoint::AddReward(id) => ControlRequest::AddReward(new_reward(id, from_json(body)?)?),
        Endpoint::EndEpisode(id) => ControlRequest::EndEpisode(episode_end(id, from_json(body)?)?),
    })
}

fn authorize(state: &AppState, req: &Request<Incoming>) -> Result<(), ApiError> {
    let Some(token) = &state.config.control_token else {
        return Ok(());
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Constant-time comparison, so the token cannot be guessed byte by byte.
    let same = given.len() == token.len()
        && given
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if same {
        Ok(())
    } else {
        Err(err(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong control token: send `Authorization: Bearer <token>` with the sidecar's --control-token",
        ))
    }
}

fn episode_id(id: &str) -> Result<String, ApiError> {
    if valid_episode_id(id) {
        Ok(id.to_owned())
    } else {
        Err(err(
            StatusCode::BAD_REQUEST,
            "invalid_episode_id",
            format!("{id:?} is not an episode id: {EPISODE_ID_RULE}"),
        ))
    }
}

async fn read_body(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    Ok(Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                err(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "too_large",
                    format!("request body is over {MAX_BODY} bytes"),
                )
            } else {
                err(
                    StatusCode::BAD_REQUEST,
                    "bad_body",
                    format!("cannot read request body: {e}"),
                )
            }
        })?
        .to_bytes())
}

fn from_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.len() > MAX_BODY {
        return Err(err(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("request body is over {MAX_BODY} bytes"),
        ));
    }
    let body: &[u8] = if body.is_empty() { b"{}" } else { body };
    serde_json::from_slice(body).map_err(|e| {
        err(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("invalid request body: {e}"),
        )
    })
}

/// The refusal of a reward or an end for an episode that is not open here.
fn not_open(episode_id: &str, why: NotOpen, what: &str) -> ApiError {
    match why {
        NotOpen::Unknown => err(
            StatusCode::NOT_FOUND,
            "unknown_episode",
            format!(
                "episode {episode_id} is not open on this sidecar, so nothing was recorded: \
                 create it with POST /tapline/v1/episodes on the sidecar that gets the {what} \
                 (open episodes are kept in the spool directory: a sidecar restarted on \
                 another --spool-dir does not know them)"
            ),
        ),
        NotOpen::Ended => err(
            StatusCode::CONFLICT,
            "episode_ended",
            format!(
                "episode {episode_id} has already ended, so this {what} was not recorded: \
                 report rewards before ending the episode, and end it once"
            ),
        ),
    }
}

async fn submit(state: &AppState, kind: RecordKind) -> Result<(), ApiError> {
    state.sink.submit(kind).await.map_err(|_| {
        err(
            StatusCode::SERVICE_UNAVAILABLE,
            "record_dropped",
            "the sidecar could not queue the record (queue full or shutting down); retry later",
        )
    })
}

/// Metadata values are kept as text: strings as they are, anything else as JSON text.
fn metadata_map(metadata: BTreeMap<String, Value>) -> BTreeMap<String, String> {
    metadata
        .into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => (k, s),
            other => (k, other.to_string()),
        })
        .collect()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateEpisode {
    task_id: String,
    #[serde(default)]
    group_id: String,
    #[serde(default)]
    episode_id: Option<String>,
    #[serde(default)]
    metadata: BTreeMap<String, Value>,
    #[serde(default)]
    bind: bool,
}

/// A checked request to create an episode.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEpisode {
    /// Task id, not empty.
    pub task_id: String,
    /// Group id.
    pub group_id: String,
    /// The episode id the harness chose (valid), if any.
    pub episode_id: Option<String>,
    /// Metadata as text.
    pub metadata: BTreeMap<String, String>,
    /// Bind the episode to this sidecar.
    pub bind: bool,
}

fn new_episode(req: CreateEpisode) -> Result<NewEpisode, ApiError> {
    if req.task_id.trim().is_empty() {
        return Err(err(
            StatusCode::BAD_REQUEST,
            "missing_task_id",
            "task_id must be a non-empty string",
        ));
    }
    Ok(NewEpisode {
        episode_id: req.episode_id.as_deref().map(episode_id).transpose()?,
        task_id: req.task_id,
        group_id: req.group_id,
        metadata: metadata_map(req.metadata),
        bind: req.bind,
    })
}

async fn create_episode(
    state: &AppState,
    host: &str,
    req: NewEpisode,
) -> Result<Response<RespBody>, ApiError> {
    let episode_id = match req.episode_id {
        Some(id) => {
            if state.episodes.get(&id).is_some() {
                return Err(err(
                    StatusCode::CONFLICT,
                    "episode_exists",
                    format!("episode {id} is already open"),
                ));
            }
            id
        }
        None => uuid::Uuid::now_v7().to_string(),
    };
    submit(
        state,
        RecordKind::EpisodeEvent(EpisodeEvent {
            event_id: uuid::Uuid::now_v7().to_string(),
            episode_id: episode_id.clone(),
            kind: EpisodeEventKind::Start as i32,
            task_id: req.task_id.clone(),
            group_id: req.group_id.clone(),
            metadata: req.metadata.clone(),
            time_unix_nanos: now_nanos(),
            bound: req.bind,
            ..Default::default()
        }),
    )
    .await?;
    state.episodes.create(
        &episode_id,
        EpisodeInfo {
            task_id: req.task_id.clone(),
            group_id: req.group_id.clone(),
            tags: req.metadata,
            ..Default::default()
        },
        req.bind,
    );
    Ok(reply(
        StatusCode::CREATED,
        json!({
            "episode_id": episode_id,
            "task_id": req.task_id,
            "group_id": req.group_id,
            "bound": req.bind,
            "base_url": format!("http://{host}/e/{episode_id}/v1"),
        }),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddReward {
    value: Option<Value>,
    #[serde(default)]
    name: String,
    #[serde(default)]
    span_id: String,
    #[serde(default)]
    tags: BTreeMap<String, String>,
}

/// A checked reward.
#[derive(Debug, Clone, PartialEq)]
pub struct NewReward {
    /// The episode (valid id).
    pub episode_id: String,
    /// Finite value.
    pub value: f64,
    /// Component name; empty for the final scalar reward.
    pub name: String,
    /// The call it rewards (valid id), or empty.
    pub span_id: String,
    /// Tags.
    pub tags: BTreeMap<String, String>,
}

fn new_reward(episode_id: String, req: AddReward) -> Result<NewReward, ApiError> {
    let value = match &req.value {
        Some(Value::Number(n)) => n.as_f64().filter(|v| v.is_finite()),
        _ => None,
    };
    let Some(value) = value else {
        return Err(err(
            StatusCode::BAD_REQUEST,
            "invalid_value",
            format!(
                "value must be a finite number, got {}",
                req.value.map_or("nothing".to_owned(), |v| v.to_string())
            ),
        ));
    };
    if !req.span_id.is_empty() && !valid_episode_id(&req.span_id) {
        return Err(err(
            StatusCode::BAD_REQUEST,
            "invalid_span_id",
            format!(
                "{:?} is not a span id (take it from the x-tapline-span-id response header)",
                req.span_id
            ),
        ));
    }
    Ok(NewReward {
        episode_id,
        value,
        name: req.name,
        span_id: req.span_id,
        tags: req.tags,
    })
}

async fn add_reward(state: &AppState, req: NewReward) -> Result<Response<RespBody>, ApiError> {
    let episode_id = req.episode_id;
    state
        .episodes
        .check_open(&episode_id)
        .map_err(|why| not_open(&episode_id, why, "reward"))?;
    let reward_id = uuid::Uuid::now_v7().to_string();
    submit(
        state,
        RecordKind::Reward(Reward {
            reward_id: reward_id.clone(),
            episode_id: episode_id.clone(),
            span_id: req.span_id,
            name: req.name,
            value: req.value,
            time_unix_nanos: now_nanos(),
            tags: req.tags,
        }),
    )
    .await?;
    Ok(reply(
        StatusCode::CREATED,
        json!({"reward_id": reward_id, "episode_id": episode_id}),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EndEpisode {
    status: String,
    #[serde(default)]
    metadata: BTreeMap<String, Value>,
}

/// A checked end of an episode.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeEnd {
    /// The episode (valid id).
    pub episode_id: String,
    /// How it ended.
    pub status: EndStatus,
    /// Metadata as text.
    pub metadata: BTreeMap<String, String>,
}

fn episode_end(episode_id: String, req: EndEpisode) -> Result<EpisodeEnd, ApiError> {
    let status = match req.status.as_str() {
        "succeeded" => EndStatus::Succeeded,
        "failed" => EndStatus::Failed,
        "timed_out" => EndStatus::TimedOut,
        "aborted" => EndStatus::Aborted,
        other => {
            return Err(err(
                StatusCode::BAD_REQUEST,
                "invalid_status",
                format!("status {other:?} is not one of succeeded, failed, timed_out, aborted"),
            ));
        }
    };
    Ok(EpisodeEnd {
        episode_id,
        status,
        metadata: metadata_map(req.metadata),
    })
}

async fn end_episode(state: &AppState, req: EpisodeEnd) -> Result<Response<RespBody>, ApiError> {
    let status = req.status;
    let (episode_id, info) = end(state, req).await?;
    Ok(reply(
        StatusCode::OK,
        json!({
            "episode_id": episode_id,
            "status": status_name(status),
            "calls": info.calls,
            // Kept for clients of the first API version: an end is only taken for an
            // episode open here.
            "known": true,
            "incomplete": info.dropped_records > 0,
        }),
    ))
}

/// Ends an open episode: takes the end (one per episode), queues its End record, and
/// reopens the episode when the record cannot be queued. Returns the episode id and
/// what was known of it.
pub async fn end(state: &AppState, req: EpisodeEnd) -> Result<(String, EpisodeInfo), ApiError> {
    let (info, was_bound) = state
        .episodes
        .end(&req.episode_id)
        .map_err(|why| not_open(&req.episode_id, why, "end"))?;
    record_end(state, req, info, was_bound).await
}

/// Ends, as `timed_out`, every open episode with no call, reward or end for longer than
/// `ttl` (`--episode-ttl-secs`), with the same End record a harness's end writes.
/// Returns how many it ended.
pub async fn end_idle_episodes(state: &AppState, ttl: Duration) -> usize {
    let mut ended = 0;
    for episode_id in state.episodes.idle(ttl) {
        // Taken only if still idle: a call may have come since the list was made.
        let Some((info, was_bound)) = state.episodes.end_idle(&episode_id, ttl) else {
            continue;
        };
        let req = EpisodeEnd {
            episode_id,
            status: EndStatus::TimedOut,
            metadata: BTreeMap::from([
                ("ended_by".to_owned(), "tapline-sidecar".to_owned()),
                (
                    "reason".to_owned(),
                    format!(
                        "no call, reward or end for {} s (--episode-ttl-secs)",
                        ttl.as_secs_f64()
                    ),
                ),
            ]),
        };
        match record_end(state, req, info, was_bound).await {
            Ok((episode_id, info)) => {
                ended += 1;
                state
                    .metrics
                    .episodes_timed_out
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    %episode_id,
                    calls = info.calls,
                    ttl_secs = ttl.as_secs_f64(),
                    "ended an idle episode as timed_out"
                );
            }
            Err(e) => tracing::warn!(
                message = %e.message,
                "could not record the end of an idle episode; trying again later"
            ),
        }
    }
    ended
}

/// Queues the End record of an episode whose end was taken, reopening it if the record
/// cannot be queued.
async fn record_end(
    state: &AppState,
    req: EpisodeEnd,
    info: EpisodeInfo,
    was_bound: bool,
) -> Result<(String, EpisodeInfo), ApiError> {
    let episode_id = req.episode_id.as_str();
    let submitted = submit(
        state,
        RecordKind::EpisodeEvent(EpisodeEvent {
            event_id: uuid::Uuid::now_v7().to_string(),
            episode_id: episode_id.to_owned(),
            kind: EpisodeEventKind::End as i32,
            task_id: info.task_id.clone(),
            group_id: info.group_id.clone(),
            status: req.status as i32,
            metadata: req.metadata,
            time_unix_nanos: now_nanos(),
            incomplete: info.dropped_records > 0,
            dropped_records: info.dropped_records,
            bound: false,
        }),
    )
    .await;
    if let Err(e) = submitted {
        state.episodes.reopen(episode_id, was_bound);
        return Err(e);
    }
    Ok((req.episode_id, info))
}

fn status_name(status: EndStatus) -> &'static str {
    match status {
        EndStatus::Succeeded => "succeeded",
        EndStatus::Failed => "failed",
        EndStatus::TimedOut => "timed_out",
        EndStatus::Aborted => "aborted",
        _ => "unspecified",
    }
}

fn health(state: &AppState) -> Response<RespBody> {
    let m = &state.metrics;
    let store_error = state.recorder.as_ref().and_then(|r| r.store_error());
    reply(
        StatusCode::OK,
        json!({
            "status": if store_error.is_some() { "degraded" } else { "ok" },
            "store_error": store_error,
            "spool_records": m.spool_records.load(Ordering::Relaxed),
            "spool_bytes": m.spool_bytes.load(Ordering::Relaxed),
            "sidecar_id": state.config.sidecar_id,
            "upstream": state.upstream_base,
            "upstream_kind": state.config.upstream_kind.as_str(),
            "store": state.store_display,
            "open_episodes": state.episodes.open_count(),
            "episode_journal": state.episodes.journal_health().map(|j| json!({
                "bytes": j.bytes,
                "errors": j.errors,
                "last_error": j.last_error,
            })),
            "bound_episode": state.episodes.bound(),
            "records_dropped": m.records_dropped.load(Ordering::Relaxed),
            "upload_failures": m.upload_failures.load(Ordering::Relaxed),
            "spool_files_set_aside": m.spool_files_set_aside.load(Ordering::Relaxed),
            "memory_budget": state.budget.health(),
            "policy": state.policy.as_ref().map(|p| p.health()),
        }),
    )
}
