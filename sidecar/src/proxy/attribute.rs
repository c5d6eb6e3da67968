//! Stage 1, attribution: which API a request is for, the path it is forwarded to, and
//! what it says about its episode (the `/e/{episode}/` path prefix and the
//! `x-tapline-*` headers, both taken off here). Nothing is read from the body yet.

use http::request::Parts;
use http::{Response, StatusCode};
use tapline_proto::Api;

use super::request::{api_error, api_of, split_episode_prefix, take_tapline_headers};
use crate::body::RespBody;
use crate::episodes::{EPISODE_ID_RULE, Hints, valid_episode_id};

/// What a request is, before its body is read.
#[derive(Debug)]
pub(super) struct Target {
    pub(super) api: Api,
    /// The path and query forwarded: the request's, less any `/e/{episode}` prefix.
    pub(super) path_and_query: String,
    /// What the path and the headers said about the episode.
    pub(super) hints: Hints,
}

/// Reads the target of a request and takes the tapline parts off it. An episode id that
/// is not one is refused with 400, in the shape of the API called.
pub(super) fn target(parts: &mut Parts) -> Result<Target, Box<Response<RespBody>>> {
    let mut hints = Hints::default();
    let original = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let path_and_query = match split_episode_prefix(original) {
        Some((id, rest)) => {
            if !valid_episode_id(id) {
                return Err(Box::new(api_error(
                    api_of(&parts.method, path_of(&rest)),
                    StatusCode::BAD_REQUEST,
                    "invalid_episode_id",
                    &format!(
                        "tapline: {id:?} in the path /e/{{episode_id}}/ is not an episode id ({EPISODE_ID_RULE}); use the base URL the tapline SDK returned"
                    ),
                )));
            }
            hints.path_episode = Some(id.to_owned());
            rest
        }
        None => original.to_owned(),
    };
    take_tapline_headers(&mut parts.headers, &mut hints);
    let api = api_of(&parts.method, path_of(&path_and_query));
    if let Some(id) = hints.header_episode.as_deref()
        && !valid_episode_id(id)
    {
        let shown: String = id.chars().take(64).collect();
        return Err(Box::new(api_error(
            api,
            StatusCode::BAD_REQUEST,
            "invalid_episode_id",
            &format!(
                "tapline: the x-tapline-episode-id header {shown:?}{} is not an episode id ({EPISODE_ID_RULE})",
                if shown.len() < id.len() { "…" } else { "" }
            ),
        )));
    }
    Ok(Target {
        api,
        path_and_query,
        hints,
    })
}

/// The path of a path and query.
fn path_of(path_and_query: &str) -> &str {
    path_and_query.split('?').next().unwrap_or("/")
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut req = http::Request::post(uri);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        req.body(()).unwrap().into_parts().0
    }

    async fn error_of(resp: Box<Response<RespBody>>) -> (StatusCode, serde_json::Value) {
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[test]
    fn the_episode_prefix_and_tapline_headers_are_taken_off() {
        let mut p = parts(
            "/e/ep-7/v1/chat/completions?trace=1",
            &[
                ("x-tapline-task-id", "task 3"),
                ("x-tapline-tag-arm", "b"),
                ("authorization", "Bearer k"),
            ],
        );
        let t = target(&mut p).unwrap();
        assert_eq!(t.api, Api::ChatCompletions);
        assert_eq!(t.path_and_query, "/v1/chat/completions?trace=1");
        assert_eq!(t.hints.path_episode.as_deref(), Some("ep-7"));
        assert_eq!(t.hints.task_id.as_deref(), Some("task 3"));
        assert_eq!(t.hints.tags.get("arm").map(String::as_str), Some("b"));
        // The harness's own headers stay; ours are gone.
        assert!(p.headers.contains_key("authorization"));
        assert!(
            !p.headers
                .keys()
                .any(|n| n.as_str().starts_with("x-tapline-"))
        );

        let mut plain = parts("/v1/messages", &[("x-tapline-episode-id", "ep-8")]);
        let t = target(&mut plain).unwrap();
        assert_eq!(t.api, Api::AnthropicMessages);
        assert_eq!(t.path_and_query, "/v1/messages");
        assert_eq!(t.hints.path_episode, None);
        assert_eq!(t.hints.header_episode.as_deref(), Some("ep-8"));
    }

    #[tokio::test]
    async fn an_episode_id_that_is_not_one_is_refused_in_the_apis_shape() {
        let mut p = parts("/e/a%20b/v1/chat/completions", &[]);
        let (status, body) = error_of(target(&mut p).unwrap_err()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["error"]["code"], "invalid_episode_id");
        assert!(body["error"]["message"].as_str().unwrap().contains("a%20b"));

        let long = "x".repeat(100) + "/";
        let mut p = parts("/v1/messages", &[("x-tapline-episode-id", &long)]);
        let (status, body) = error_of(target(&mut p).unwrap_err()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        // Anthropic's error shape, and the id shown cut at 64 characters.
        assert_eq!(body["type"], "error");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("{:?}…", "x".repeat(64))),
            "{message}"
        );
    }
}
