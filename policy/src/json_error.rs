//! How serde errors are reported, shared by policy-set parsing and the
//! compiled document's loader: the path as written, and serde's message
//! without its position (which both report in their own fields).

/// A path as `policies[2].match`; empty at the document root.
pub(crate) fn path_string(p: &serde_path_to_error::Path) -> String {
    let s = p.to_string();
    if s == "." {
        String::new()
    } else {
        s
    }
}

/// Strips serde_json's " at line L column C" suffix (reported separately).
pub(crate) fn serde_message(e: &serde_json::Error) -> String {
    let s = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    s.strip_suffix(&suffix).map(str::to_owned).unwrap_or(s)
}
