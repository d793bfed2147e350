//! E-mail addresses, found from their `@`.

use std::ops::{ControlFlow, Range};

use crate::types::PiiKind;

fn local_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'%' | b'+' | b'-')
}

pub(super) fn scan_emails(
    b: &[u8],
    f: &mut dyn FnMut(PiiKind, Range<usize>) -> ControlFlow<()>,
) -> ControlFlow<()> {
    let mut k = 0;
    while let Some(off) = b[k..].iter().position(|&c| c == b'@') {
        let at = k + off;
        match email_around(b, at) {
            Some(r) => {
                k = r.end;
                f(PiiKind::Email, r)?;
            }
            None => k = at + 1,
        }
    }
    ControlFlow::Continue(())
}

fn email_around(b: &[u8], at: usize) -> Option<Range<usize>> {
    let mut s = at;
    while s > 0 && local_char(b[s - 1]) && at - s < 64 {
        s -= 1;
    }
    if s == at || b[s] == b'.' || b[at - 1] == b'.' {
        return None;
    }
    // Domain: labels of [A-Za-z0-9-], split by single dots.
    let mut j = at + 1;
    let mut labels = 0;
    let mut last_start;
    loop {
        last_start = j;
        while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'-') {
            j += 1;
        }
        let label = &b[last_start..j];
        if label.is_empty() || label[0] == b'-' || label[label.len() - 1] == b'-' {
            return None;
        }
        labels += 1;
        if j + 1 < b.len() && b[j] == b'.' && b[j + 1].is_ascii_alphanumeric() {
            j += 1;
            continue;
        }
        break;
    }
    let tld = &b[last_start..j];
    if labels < 2 || tld.len() < 2 || !tld.iter().all(u8::is_ascii_alphabetic) {
        return None;
    }
    Some(s..j)
}
