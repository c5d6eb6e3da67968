//! `tapline-sidecar`: see `tapline-sidecar --help`.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tapline-sidecar",
    version,
    about = "Records an agent harness's LLM traffic for RL training."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print every record in a store as one JSON object per line.
    Dump {
        /// Store URL: file:///dir, s3://bucket/prefix, gs://, az://, memory://, or a directory.
        #[arg(long, env = "TAPLINE_STORE")]
        store: String,
        /// Only segments whose key starts with this, relative to the segments directory
        /// (e.g. `2026/12/02` or `2026/12/02/09/my-sidecar`).
        #[arg(long)]
        prefix: Option<String>,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Dump { store, prefix } => {
            let location = tapline_proto::store::open_store(&store)?;
            let mut out = std::io::BufWriter::new(std::io::stdout());
            let summary =
                tapline_sidecar::dump::dump(&location, prefix.as_deref(), &mut out).await?;
            eprintln!(
                "dump: {} records from {} segments",
                summary.records, summary.segments
            );
        }
    }
    Ok(())
}
