//! The tapline sidecar: runs beside one agent harness, proxies its LLM traffic, records
//! every call, and ships the records to object storage.
//!
//! - [`dump`]: prints every record of a store as JSON lines (`tapline-sidecar dump`).

pub mod dump;
