//! The sidecar's borrowed JSON tree: never a panic; what it accepts, serde_json accepts,
//! and what it writes reads back the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tapline_sidecar::json::Json;

fuzz_target!(|data: &[u8]| {
    let Ok(tree) = Json::parse(data) else {
        return;
    };
    let text = tree.to_string();
    let again = Json::parse(text.as_bytes()).expect("the tree's own text parses");
    assert_eq!(again.to_string(), text, "writing is stable");
    let _ = serde_json::to_vec(&tree).expect("the tree serializes");
    // Accessors on whatever shape came in.
    let _ = (
        tree.get("choices"),
        tree.as_str(),
        tree.as_u64(),
        tree.as_f64(),
    );
    if let Some(items) = tree.as_array() {
        for item in items {
            let _ = (item.is_object(), item.is_null(), item.get("delta"));
        }
    }
});
