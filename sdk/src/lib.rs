//! Report episodes and rewards from an agent harness to its tapline sidecar.
//!
//! The client is not written yet; the sidecar's control API it will speak is
//! described in ARCHITECTURE.md.
