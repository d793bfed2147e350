//! The policy document: parser, validator and compiler, and the compiled
//! document's loader (the filter's `on_configure`). A set that validates
//! compiles; a compiled document reads back as itself.
#![no_main]

use kvasir_policy::{compile, parse_json_slice, validate, FilterConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(cfg) = FilterConfig::from_json(data) {
        round_trip(&cfg);
    }
    let Ok(set) = parse_json_slice(data) else {
        return;
    };
    let valid = validate(&set).is_ok();
    match compile(&set) {
        Ok(cfg) => {
            assert!(valid, "compiled a set that does not validate");
            round_trip(&cfg);
        }
        Err(errors) => {
            assert!(!valid, "a valid set failed to compile: {errors:?}");
            assert!(!errors.is_empty(), "refused without a reason");
        }
    }
});

fn round_trip(cfg: &FilterConfig) {
    let bytes = cfg.to_json();
    let back = FilterConfig::from_json(&bytes).unwrap_or_else(|e| {
        panic!(
            "compiled document refused ({e}): {}",
            String::from_utf8_lossy(&bytes)
        )
    });
    assert!(back == *cfg, "compiled document changed on reading");
}
