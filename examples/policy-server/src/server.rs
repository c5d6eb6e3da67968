//! HTTP: the listener (hyper 1, HTTP/1.1 keep-alive, graceful shutdown) and the routes.
//!
//! | route | answer |
//! |---|---|
//! | `POST /v1/chat/completions` | a completion, JSON or server-sent events |
//! | `GET /v1/models` | the served model |
//! | `GET /health` | `{"status", "model", "model_dir", "version"}` |
//! | `POST /v1/reload` `{"path"}` | loads a checkpoint; 400 (old one keeps serving) when it cannot |
//!
//! Requests are checked here ([`crate::api`]) and generated on the inference thread
//! ([`crate::engine`]); every completion response carries `x-tapline-policy-version`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};

use crate::api::{ApiError, ChatParams};
use crate::engine::{EngineHandle, Event, Job, TokenEvent};
use crate::response::{self, Meta, SseBody};

/// The header that names the weights that served a completion.
pub const VERSION_HEADER: &str = "x-tapline-policy-version";

/// The largest request body accepted.
const MAX_BODY_BYTES: usize = 32 << 20;

/// A response body.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Everything a request handler needs.
#[derive(Debug)]
pub struct App {
    /// The inference thread.
    pub engine: EngineHandle,
    /// The name in `model` fields.
    pub served_model_name: String,
    /// Unix seconds at start (`created` of the model).
    pub started: u64,
    /// For response ids.
    pub requests: AtomicU64,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl App {
    /// The state of a server over `engine`.
    pub fn new(engine: EngineHandle, served_model_name: String) -> Self {
        App {
            engine,
            served_model_name,
            started: now_secs(),
            requests: AtomicU64::new(0),
        }
    }

    fn next_id(&self) -> String {
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        format!("chatcmpl-{nanos:016x}{n:016x}")
    }
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed_unsync()
}

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut resp = Response::new(full(value.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn error_response(error: &ApiError) -> Response<Body> {
    json_response(error.status, &error.to_json())
}

fn with_version(mut resp: Response<Body>, version: &str) -> Response<Body> {
    if let Ok(v) = HeaderValue::from_str(version) {
        resp.headers_mut().insert(VERSION_HEADER, v);
    }
    resp
}

/// Routes one request.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().trim_end_matches('/').to_owned();
    let method = req.method().clone();
    let resp = match (path.as_str(), &method) {
        ("/v1/chat/completions", &Method::POST) => chat(&app, req).await,
        ("/v1/models", &Method::GET) => models(&app),
        ("/health", &Method::GET) => health(&app),
        ("/v1/reload", &Method::POST) => reload(&app, req).await,
        ("/v1/load_lora_adapter", &Method::POST) => load_adapter(&app, req).await,
        ("/v1/unload_lora_adapter", &Method::POST) => unload_adapter(&app, req).await,
        (
            "/v1/chat/completions"
            | "/v1/models"
            | "/health"
            | "/v1/reload"
            | "/v1/load_lora_adapter"
            | "/v1/unload_lora_adapter",
            _,
        ) => error_response(&ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{method} is not allowed on {path}"),
        )),
        _ => error_response(&ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "no route {method} {path}; this server has POST /v1/chat/completions, GET /v1/models, GET /health and POST /v1/reload"
            ),
        )),
    };
    Ok(resp)
}

/// Reads a JSON request body.
async fn read_json(req: Request<Incoming>) -> Result<Value, ApiError> {
    let body = Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
                )
            } else {
                ApiError::bad_request(format!("reading the request body: {e}"))
            }
        })?
        .to_bytes();
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))
}

async fn chat(app: &App, req: Request<Incoming>) -> Response<Body> {
    let current = || app.engine.loaded().version;
    let mut params = match read_json(req).await.and_then(|v| ChatParams::from_json(&v)) {
        Ok(params) => params,
        Err(error) => return with_version(error_response(&error), &current()),
    };
    // The served name (or none) is the base weights; an adapter is answered under its own
    // name; any other name is a 404, as vLLM answers it (a caller that names a version
    // must never get other weights than it named).
    if params.model.as_deref() == Some(app.served_model_name.as_str()) {
        params.model = None;
    }
    if let Some(m) = &params.model
        && !app
            .engine
            .adapters
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains_key(m)
    {
        return with_version(
            error_response(&crate::engine::model_not_found(m)),
            &current(),
        );
    }
    let adapter = params.model.clone();
    let meta = Meta {
        id: app.next_id(),
        created: now_secs(),
        model: adapter.unwrap_or_else(|| app.served_model_name.clone()),
        logprobs: params.logprobs,
        token_ids: params.return_token_ids,
    };
    let (stream, include_usage) = (params.stream, params.include_usage);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let job = Job::Generate {
        params: Box::new(params),
        events: tx,
    };
    if app.engine.jobs.send(job).await.is_err() {
        return error_response(&ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the inference thread has stopped",
        ));
    }
    let (version, prompt_ids) = match rx.recv().await {
        Some(Event::Started {
            version,
            prompt_ids,
        }) => (version, prompt_ids),
        Some(Event::Failed(error)) => return with_version(error_response(&error), &current()),
        _ => {
            return error_response(&ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the inference thread stopped before the generation started",
            ));
        }
    };
    if stream {
        let body = SseBody::new(meta, &prompt_ids, include_usage, rx);
        let mut resp = Response::new(body.boxed_unsync());
        let headers = resp.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return with_version(resp, &version);
    }
    let mut tokens: Vec<TokenEvent> = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::Token(t)) => {
                let finish = t.finish.clone();
                tokens.push(t);
                if let Some(finish) = finish {
                    let value = response::completion(&meta, &prompt_ids, &tokens, &finish);
                    return with_version(json_response(StatusCode::OK, &value), &version);
                }
            }
            Some(Event::Started { .. }) => {}
            Some(Event::Failed(error)) => {
                return with_version(error_response(&error), &version);
            }
            None => {
                return with_version(
                    error_response(&ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "the inference thread stopped during the generation",
                    )),
                    &version,
                );
            }
        }
    }
}

fn models(app: &App) -> Response<Body> {
    let loaded = app.engine.loaded();
    let mut data = vec![json!({
        "id": app.served_model_name,
        "object": "model",
        "created": app.started,
        "owned_by": "tapline",
        "root": loaded.dir.display().to_string(),
        "parent": null,
        "max_model_len": loaded.max_model_len,
    })];
    let adapters = app
        .engine
        .adapters
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    for (name, adapter) in adapters {
        data.push(json!({
            "id": name,
            "object": "model",
            "created": app.started,
            "owned_by": "tapline",
            "root": adapter.dir.display().to_string(),
            "parent": app.served_model_name,
            "max_model_len": adapter.max_model_len,
        }));
    }
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// A string field of a JSON body, or the error naming it.
fn string_field<'a>(body: &'a Value, name: &'static str) -> Result<&'a str, ApiError> {
    body.get(name)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| {
            ApiError::field(
                name,
                format!("`{name}` is required and must be a non-empty string"),
            )
        })
}

fn text_response(text: String) -> Response<Body> {
    let mut resp = Response::new(full(text));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`, as vLLM answers it.
async fn load_adapter(app: &App, req: Request<Incoming>) -> Response<Body> {
    let body = match read_json(req).await {
        Ok(body) => body,
        Err(error) => return error_response(&error),
    };
    let (name, path) = match (
        string_field(&body, "lora_name"),
        string_field(&body, "lora_path"),
    ) {
        (Ok(n), Ok(p)) => (n.to_owned(), p.to_owned()),
        (Err(e), _) | (_, Err(e)) => return error_response(&e),
    };
    let (reply, answer) = oneshot::channel();
    let job = Job::LoadAdapter {
        name: name.clone(),
        dir: PathBuf::from(&path),
        reply,
    };
    if app.engine.jobs.send(job).await.is_err() {
        return error_response(&ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the inference thread has stopped",
        ));
    }
    match answer.await {
        Ok(Ok(())) => text_response(format!(
            "Success: LoRA adapter '{name}' added successfully."
        )),
        Ok(Err(message)) => error_response(&ApiError::field("lora_path", message)),
        Err(_) => error_response(&ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the inference thread stopped while loading",
        )),
    }
}

/// `POST /v1/unload_lora_adapter {"lora_name"}`.
async fn unload_adapter(app: &App, req: Request<Incoming>) -> Response<Body> {
    let body = match read_json(req).await {
        Ok(body) => body,
        Err(error) => return error_response(&error),
    };
    let name = match string_field(&body, "lora_name") {
        Ok(n) => n.to_owned(),
        Err(e) => return error_response(&e),
    };
    let (reply, answer) = oneshot::channel();
    if app
        .engine
        .jobs
        .send(Job::UnloadAdapter {
            name: name.clone(),
            reply,
        })
        .await
        .is_err()
    {
        return error_response(&ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the inference thread has stopped",
        ));
    }
    match answer.await {
        Ok(Ok(())) => text_response(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        )),
        Ok(Err(message)) => error_response(&ApiError::new(StatusCode::NOT_FOUND, message)),
        Err(_) => error_response(&ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the inference thread stopped while unloading",
        )),
    }
}

fn health(app: &App) -> Response<Body> {
    let loaded = app.engine.loaded();
    json_response(
        StatusCode::OK,
        &json!({
            "status": "ok",
            "model": app.served_model_name,
            "model_dir": loaded.dir.display().to_string(),
            "version": loaded.version,
        }),
    )
}

/// Asks the inference thread to load `dir`.
pub async fn load(engine: &EngineHandle, dir: PathBuf) -> Result<crate::engine::Loaded, String> {
    let (reply, answer) = oneshot::channel();
    engine
        .jobs
        .send(Job::Reload { dir, reply })
        .await
        .map_err(|_| "the inference thread has stopped".to_owned())?;
    answer
        .await
        .map_err(|_| "the inference thread stopped while loading".to_owned())?
}

async fn reload(app: &App, req: Request<Incoming>) -> Response<Body> {
    let body = match read_json(req).await {
        Ok(body) => body,
        Err(error) => return error_response(&error),
    };
    let Some(path) = body.get("path").and_then(Value::as_str) else {
        return error_response(&ApiError::field(
            "path",
            "`path` (a checkpoint directory) is required and must be a string",
        ));
    };
    match load(&app.engine, PathBuf::from(path)).await {
        Ok(loaded) => json_response(
            StatusCode::OK,
            &json!({
                "status": "ok",
                "model_dir": loaded.dir.display().to_string(),
                "version": loaded.version,
            }),
        ),
        Err(message) => error_response(&ApiError::field(
            "path",
            format!(
                "`path` {path:?} was not loaded (the previous weights keep serving): {message}"
            ),
        )),
    }
}

/// Serves connections on `listener` until `stop` turns true, then lets open requests
/// finish for up to `drain`.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    mut stop: watch::Receiver<bool>,
    drain: Duration,
) {
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer): (_, SocketAddr) = match accepted {
                    Ok(conn) => conn,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let app = app.clone();
                let service = service_fn(move |req| handle(app.clone(), req));
                let conn = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(60))
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(stream), service);
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(error) = conn.await {
                        tracing::debug!(%error, %peer, "connection ended with an error");
                    }
                });
            }
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(?drain, "open requests did not finish in time; closing them");
    }
}
