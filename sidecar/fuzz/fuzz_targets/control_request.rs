//! The control API's routing and body checks on arbitrary methods, paths and bodies:
//! never a panic, refusals are 4xx, and what is accepted holds only valid ids and
//! finite rewards.
#![no_main]

use http::Method;
use libfuzzer_sys::fuzz_target;
use tapline_sidecar::control::{ControlRequest, endpoint, parse};
use tapline_sidecar::episodes::valid_episode_id;

// Input: one byte choosing the method and path shape, the path's variable part up to the
// first newline, then the body. Seeds are easy to write by hand (see corpus/).
fuzz_target!(|data: &[u8]| {
    let Some((&choice, rest)) = data.split_first() else {
        return;
    };
    let (part, body) = match rest.iter().position(|&b| b == b'\n') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let part = String::from_utf8_lossy(part);
    let path = match (choice >> 1) % 5 {
        0 => "/tapline/v1/health".to_owned(),
        1 => "/tapline/v1/episodes".to_owned(),
        2 => format!("/tapline/v1/episodes/{part}/rewards"),
        3 => format!("/tapline/v1/episodes/{part}/end"),
        _ => part.into_owned(),
    };
    let method = if choice & 1 == 1 {
        Method::POST
    } else {
        Method::GET
    };
    let routed = match endpoint(&method, &path) {
        Ok(e) => e,
        Err(e) => {
            assert!(e.status.is_client_error(), "{e:?}");
            return;
        }
    };
    match parse(routed.clone(), body) {
        Ok(ControlRequest::Health) => {}
        Ok(ControlRequest::CreateEpisode(new)) => {
            assert!(!new.task_id.trim().is_empty());
            if let Some(id) = &new.episode_id {
                assert!(valid_episode_id(id), "{id:?}");
            }
        }
        Ok(ControlRequest::AddReward(reward)) => {
            assert!(valid_episode_id(&reward.episode_id));
            assert!(reward.value.is_finite());
            assert!(reward.span_id.is_empty() || valid_episode_id(&reward.span_id));
        }
        Ok(ControlRequest::EndEpisode(end)) => assert!(valid_episode_id(&end.episode_id)),
        Err(e) => assert!(e.status.is_client_error(), "{e:?}"),
    }
    // Pure: the same request gives the same answer.
    assert_eq!(
        format!("{:?}", parse(routed.clone(), body)),
        format!("{:?}", parse(routed, body))
    );
});
