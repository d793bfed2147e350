//! Prometheus text-format samples: `name{label="value",...} value
//! [timestamp]` lines, read into a name, unescaped labels and a value.
//!
//! Comment (`#`) and blank lines are skipped; `NaN`, `+Inf` and `-Inf` are
//! values like any other; a timestamp is read past, not kept. An error names
//! the 1-based line of the page, so a bad page says where it went wrong.
//!
//! Two readings of a page: [`samples`] reads every line and fails on any it
//! cannot read, for pages this project writes itself; [`samples_of`] and
//! [`sum`] read only the lines of the named metrics and pass over the rest
//! unread, so an exporter's exotic line elsewhere on the page does not cost
//! a scrape of the metrics that matter.
//!
//! The Python tests and benchmarks have their own parser
//! (`harness/kvasir_harness/prom.py`).

#![warn(missing_docs)]

/// One sample of a Prometheus text page.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// Metric name, as written (a counter's `_total` included).
    pub name: &'a str,
    /// Labels in page order, values unescaped.
    pub labels: Vec<(&'a str, String)>,
    /// Value.
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Why a line is not a sample.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyntaxError {
    /// Nothing follows the name (and labels).
    #[error("no value")]
    NoValue,
    /// The name has characters a metric name cannot have.
    #[error("bad metric name `{0}`")]
    BadName(String),
    /// A label has no `=`.
    #[error("label without =")]
    LabelWithoutEquals,
    /// A label's value does not start with `"`.
    #[error("label value not quoted")]
    LabelNotQuoted,
    /// A label's value has no closing `"`.
    #[error("unterminated label value")]
    UnterminatedLabel,
    /// The line ends in the middle of a `\` escape.
    #[error("unterminated escape")]
    UnterminatedEscape,
    /// The value is not a number.
    #[error("bad value `{0}`")]
    BadValue(String),
}

/// A line of a page that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct Error {
    /// 1-based line number in the page.
    pub line: usize,
    /// What is wrong with it.
    pub reason: SyntaxError,
}

/// Parses one sample line (`name{a="b",...} value [timestamp]`); leading
/// and trailing whitespace is ignored.
pub fn parse_sample(line: &str) -> Result<Sample<'_>, SyntaxError> {
    let line = line.trim();
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or(SyntaxError::NoValue)?;
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    {
        return Err(SyntaxError::BadName(name.to_string()));
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        rest = r;
        loop {
            rest = rest.trim_start();
            if let Some(r) = rest.strip_prefix('}') {
                rest = r;
                break;
            }
            let eq = rest.find('=').ok_or(SyntaxError::LabelWithoutEquals)?;
            let key = rest[..eq].trim();
            rest = rest[eq + 1..].trim_start();
            rest = rest.strip_prefix('"').ok_or(SyntaxError::LabelNotQuoted)?;
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let end = loop {
                match chars.next() {
                    None => return Err(SyntaxError::UnterminatedLabel),
                    Some((i, '"')) => break i,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c)) => value.push(c),
                        None => return Err(SyntaxError::UnterminatedEscape),
                    },
                    Some((_, c)) => value.push(c),
                }
            };
            labels.push((key, value));
            rest = rest[end + 1..].trim_start();
            if let Some(r) = rest.strip_prefix(',') {
                rest = r;
            }
        }
    }
    let v = rest.split_whitespace().next().ok_or(SyntaxError::NoValue)?;
    let value = match v {
        "NaN" => f64::NAN,
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v
            .parse::<f64>()
            .map_err(|_| SyntaxError::BadValue(v.to_string()))?,
    };
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// The page's sample lines, trimmed, with their 1-based numbers.
fn sample_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
}

fn parse_at(line: usize, text: &str) -> Result<Sample<'_>, Error> {
    parse_sample(text).map_err(|reason| Error { line, reason })
}

/// Every sample of a page, in order; a line that is not a sample is an
/// error (and the iteration goes on past it).
pub fn samples(text: &str) -> impl Iterator<Item = Result<Sample<'_>, Error>> {
    sample_lines(text).map(|(n, l)| parse_at(n, l))
}

/// The samples of the metrics named `names`, in page order. Only their
/// lines are parsed, so a malformed line of one of them is an error and
/// any other line, malformed or not, is passed over.
pub fn samples_of<'a>(
    text: &'a str,
    names: &'a [&'a str],
) -> impl Iterator<Item = Result<Sample<'a>, Error>> + 'a {
    sample_lines(text)
        .filter(|(_, l)| {
            // The name as written runs to the labels or the value.
            l.find(|c: char| c == '{' || c.is_whitespace())
                .is_some_and(|end| names.contains(&&l[..end]))
        })
        .map(|(n, l)| parse_at(n, l))
}

/// The sum of the values of `name`'s samples (0.0 when there are none, NaN
/// when one is NaN); lines of other metrics are passed over unread, as in
/// [`samples_of`].
pub fn sum(text: &str, name: &str) -> Result<f64, Error> {
    samples_of(text, &[name]).map(|s| s.map(|s| s.value)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_samples_with_escapes_and_specials() {
        let s = parse_sample(r#"m{a="x\"y",b="c\\d\n",} +Inf 123"#).unwrap();
        assert_eq!(s.name, "m");
        assert_eq!(
            s.labels,
            vec![("a", "x\"y".to_string()), ("b", "c\\d\n".to_string())]
        );
        assert_eq!(s.label("b"), Some("c\\d\n"));
        assert_eq!(s.label("c"), None);
        assert!(s.value.is_infinite());
        assert_eq!(parse_sample("up 1").unwrap().value, 1.0);
        assert!(parse_sample("up NaN").unwrap().value.is_nan());
        assert_eq!(parse_sample("up -Inf").unwrap().value, f64::NEG_INFINITY);
        assert!(parse_sample("bad-name 1").is_err());
        assert!(parse_sample(r#"m{a="x} 1"#).is_err());
        assert!(parse_sample("m{a=\"x\"} notanumber").is_err());
    }

    #[test]
    fn errors_say_what_is_wrong() {
        assert_eq!(parse_sample("up"), Err(SyntaxError::NoValue));
        assert_eq!(parse_sample("up{} "), Err(SyntaxError::NoValue));
        assert_eq!(
            parse_sample("bad-name 1"),
            Err(SyntaxError::BadName("bad-name".into()))
        );
        assert_eq!(parse_sample("m{a} 1"), Err(SyntaxError::LabelWithoutEquals));
        assert_eq!(parse_sample("m{a=x} 1"), Err(SyntaxError::LabelNotQuoted));
        assert_eq!(
            parse_sample(r#"m{a="x} 1"#),
            Err(SyntaxError::UnterminatedLabel)
        );
        assert_eq!(
            parse_sample(r#"m{a="x\"#),
            Err(SyntaxError::UnterminatedEscape)
        );
        assert_eq!(
            parse_sample("m 1x").unwrap_err().to_string(),
            "bad value `1x`"
        );
    }

    #[test]
    fn samples_skip_comments_and_name_the_bad_line() {
        let page =
            "# HELP up Up.\n# TYPE up gauge\n\nup{job=\"a\"} 1\n  up 0 1700000000000\nbad-name 1\n";
        let got: Vec<_> = samples(page).collect();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].as_ref().unwrap().label("job"), Some("a"));
        assert_eq!(got[1].as_ref().unwrap().value, 0.0);
        let err = got[2].as_ref().unwrap_err();
        assert_eq!(err.line, 6);
        assert_eq!(err.to_string(), "line 6: bad metric name `bad-name`");
    }

    #[test]
    fn samples_of_read_only_the_named_metrics() {
        let page = "a 1\na_total 2\ngarbage{ 1\na{x=\"y\"} 3\nb x\n";
        let got: Vec<f64> = samples_of(page, &["a"]).map(|s| s.unwrap().value).collect();
        assert_eq!(got, vec![1.0, 3.0]);
        let bad: Vec<_> = samples_of(page, &["a", "b"]).collect();
        assert_eq!(bad.len(), 3);
        assert_eq!(bad[2].as_ref().unwrap_err().line, 5);
    }

    #[test]
    fn prometheus_sums_ignore_other_metrics_and_comments() {
        let t = "# HELP x\nvllm_sim:prefill_seconds_total{model_name=\"m\"} 1.5\n\
                 vllm_sim:prefill_seconds_total_other 9\nvllm:x 3\nvllm_sim:prefill_seconds_total{a=\"b\"} 0.5\n";
        assert_eq!(sum(t, "vllm_sim:prefill_seconds_total").unwrap(), 2.0);
        assert_eq!(sum(t, "missing").unwrap(), 0.0);
        // A timestamp is not the value.
        assert_eq!(sum("c 2 1700000000000\nc 1\n", "c").unwrap(), 3.0);
        assert!(sum("c 1\nc NaN\n", "c").unwrap().is_nan());
        assert_eq!(sum("c 1\nc{ 2\n", "c").unwrap_err().line, 2);
    }
}
