//! `kvasirctl`'s YAML reader and what reads its documents: every node's
//! position is inside the text (or just past its end), a path's position
//! is its own, and reading then validating the documents (any resources,
//! any targets) never panics and reports valid exactly when it has no
//! errors.
#![no_main]

use kvasirctl::{validate, yaml, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Lines as YAML counts them: a CR alone breaks a line too.
    let lines = text.replace("\r\n", "\n").split(['\n', '\r']).count();
    match yaml::parse(text) {
        Ok(docs) => {
            // Empty documents are skipped but counted.
            let mut last = 0;
            for doc in &docs {
                assert!(doc.index > last, "document {} after {last}", doc.index);
                last = doc.index;
                for (path, pos) in &doc.positions {
                    // An empty node at the end of the stream sits just past it.
                    assert!(pos.line >= 1 && pos.line <= lines + 1, "{path}: {pos:?}");
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
