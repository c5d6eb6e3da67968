//! The spool's crash recovery and sealed-file reader on arbitrary file contents: never a
//! panic; recovery keeps the good prefix, and after it the spool appends and reads back.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tapline_proto::{RecordKind, Reward};
use tapline_sidecar::spool::{Spool, read_sealed};

fn dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a temporary directory"))
}

fuzz_target!(|data: &[u8]| {
    let root = dir().path();
    let spool_dir = root.join("spool");
    let _ = std::fs::remove_dir_all(&spool_dir);
    std::fs::create_dir_all(&spool_dir).unwrap();

    // As a sealed file: read whole or refused, never a panic.
    let sealed = root.join("0000000000000001.sealed");
    std::fs::write(&sealed, data).unwrap();
    let whole = read_sealed(&sealed);

    // As the open file of a crashed sidecar: recovery cuts the damaged tail.
    std::fs::write(spool_dir.join("0000000000000001.open"), data).unwrap();
    let Ok((mut spool, recovery)) = Spool::open(&spool_dir, 1 << 30, 0) else {
        return;
    };
    if let Ok(records) = &whole {
        assert_eq!(
            recovery.records,
            records.len() as u64,
            "an undamaged file is recovered whole"
        );
    }
    let recovered = spool.records();
    let mut next = Some(RecordKind::Reward(Reward {
        reward_id: "after-recovery".into(),
        episode_id: "e".into(),
        value: 1.0,
        ..Default::default()
    }));
    spool
        .append("fuzz", 0, &mut next)
        .expect("appending after recovery");
    let sealed = spool.seal().unwrap().expect("a sealed file");
    let back = read_sealed(&sealed.path).expect("a file the spool wrote reads back");
    match back.last().and_then(|r| r.kind.as_ref()) {
        Some(RecordKind::Reward(r)) => assert_eq!(r.reward_id, "after-recovery"),
        other => panic!("the appended record did not read back: {other:?}"),
    }
    assert_eq!(spool.records(), recovered + 1);
});
