//! `kvasirctl`'s YAML reader and what reads its documents: every node's
//! position is inside the text, a path's position is its own, and reading
//! then validating the documents (any resources, any targets) never
//! panics and reports valid exactly when it has no errors.
#![no_main]

use kvasirctl::{validate, yaml, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let lines = text.split('\n').count();
    match yaml::parse(text) {
        Ok(docs) => {
            for (i, doc) in docs.iter().enumerate() {
                assert_eq!(doc.index, i + 1);
                for (path, pos) in &doc.positions {
                    assert!(pos.line >= 1 && pos.line <= lines, "{path}: {pos:?}");
                    assert!(pos.column >= 1, "{path}: {pos:?}");
                    assert_eq!(doc.position(path), *pos, "{path}");
                }
            }
        }
        Err(e) => assert!(e.pos.line >= 1 && e.pos.line <= lines + 1, "{e:?}"),
    }
    let mut input = Input::default();
    input.add_text("fuzz.yaml", text, "default");
    let report = validate(&input, &kvasir_api::Options::default());
    assert_eq!(report.valid, report.errors.is_empty());
    let _ = report.text();
});
