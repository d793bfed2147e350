//! The Prometheus text parser. A sample that parses, written back out in
//! the exposition format, parses to the same sample; `sum` of a metric is
//! the sum of its samples, and fails exactly when one of them does.
#![no_main]

use kvasir_promtext::{parse_sample, samples, sum, Sample};
use libfuzzer_sys::fuzz_target;

fn render(s: &Sample<'_>) -> String {
    let mut out = s.name.to_owned();
    out.push('{');
    for (k, v) in &s.labels {
        let v = v
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        out.push_str(&format!("{k}=\"{v}\","));
    }
    out.push_str("} ");
    out.push_str(&match s.value {
        v if v.is_nan() => "NaN".to_owned(),
        f64::INFINITY => "+Inf".to_owned(),
        f64::NEG_INFINITY => "-Inf".to_owned(),
        v => format!("{v:?}"),
    });
    out
}

fn same(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let all: Vec<_> = samples(text).collect();
    let mut names = Vec::new();
    for s in all.iter().flatten() {
        let line = render(s);
        let back = parse_sample(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert_eq!(back.name, s.name, "{line:?}");
        assert_eq!(back.labels, s.labels, "{line:?}");
        assert!(same(back.value, s.value), "{line:?}");
        if !names.contains(&s.name) {
            names.push(s.name);
        }
    }
    for name in names {
        let of_name: Vec<_> = all
            .iter()
            .filter(|r| r.as_ref().is_ok_and(|s| s.name == name))
            .map(|r| r.as_ref().map(|s| s.value))
            .collect();
        let expected: f64 = of_name.iter().map(|v| *v.as_ref().expect("ok")).sum();
        match sum(text, name) {
            Ok(got) => assert!(same(got, expected), "{name}: {got} vs {expected}"),
            // A malformed line whose name reads as `name`.
            Err(e) => assert!(
                all.iter()
                    .any(|r| r.as_ref().is_err_and(|x| x.line == e.line)),
                "{name}: {e}"
            ),
        }
    }
});
