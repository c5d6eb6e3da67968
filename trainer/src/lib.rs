//! The tapline trainer's data pipeline: stored records in, exact, normalized training
//! batches out.
//!
//! One module per stage, each a pure function of its input except [`ingest`], the only
//! one that talks to object storage:
//!
//! 1. [`ingest`] — segments after the run's cursor → deduplicated records → episodes;
//! 2. [`clean`] — drops with a named reason and a count;
//! 3. [`tokenize`] — recorded ids, or the chat template ([`template`], [`model`]) and
//!    the tokenizer; drift between the two is named by [`drift`];
//! 4. [`merge`] — consecutive calls into sequences on exact id prefixes;
//! 5. [`advantages`] — GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline;
//! 6. [`schedule`] — loss weights fixed per mini-batch, micro-batch packing;
//! 7. [`output`] — the documented batch files; [`report`] — what happened.
//!
//! [`pipeline::prepare`] runs stages 2–6; [`config::RunConfig`] configures them all.
//! [`export`] reads the same records into Parquet files for data tools; [`track`]
//! writes what `train` does while it runs (`metrics.jsonl`, TensorBoard, MLflow);
//! [`html`] the run's `report.html`.

pub mod advantages;
pub mod batch;
pub mod chart;
pub mod clean;
pub mod config;
pub mod drift;
pub mod export;
pub mod fidelity;
pub mod flatten;
pub mod html;
pub mod ingest;
pub mod merge;
pub mod model;
pub mod nn;
pub mod output;
pub mod pipeline;
pub mod publish;
pub mod report;
pub mod schedule;
pub mod template;
pub mod tokenize;
pub mod track;

/// The commit the binary was built from (`unknown` outside a git checkout).
pub const GIT_COMMIT: &str = env!("TAPLINE_GIT_COMMIT");

pub use config::RunConfig;
pub use model::{Model, ModelOptions};
pub use pipeline::{Prepared, prepare};
