//! `tapline-trainer`: turns captured records into policy-gradient updates.

fn main() {
    eprintln!(
        "tapline-trainer: no commands are built yet; `tapline-sidecar dump --store URL` shows the records a run will read"
    );
    std::process::exit(2);
}
