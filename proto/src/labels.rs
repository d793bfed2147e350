//! The words of the contract's closed sets: one table per enum, used for
//! metric labels, stat names, logs and the deprecated string fields, so
//! the words (which dashboards and alerts match) are defined once.
//!
//! Reading an answer goes through the `resolved_*` methods: the enum, or
//! when it is UNSPECIFIED (an indexer that predates it) the word beside
//! it. Writing goes through the `set_*` methods, which fill both while
//! the words are still on the wire.

use kvasir_budget::{Dimension, Refusal};

use crate::v1::{BudgetStatus, Decision, LimitedBy, PickResponse, PoolStateResponse};
use crate::v1::{ShedCause, TokenizeMode};

/// Defines `as_label`, `from_label`, `position` and `KNOWN` (every value
/// but UNSPECIFIED, in metric label order) from one table.
macro_rules! labels {
    ($ty:ident, unspecified = $none:literal, { $($v:ident => $w:literal,)+ }) => {
        impl $ty {
            /// Every value but UNSPECIFIED, in metric label order.
            pub const KNOWN: [$ty; [$($w),+].len()] = [$($ty::$v),+];

            /// The value's word (metric label, stat segment, log word).
            pub fn as_label(self) -> &'static str {
                match self {
                    $ty::Unspecified => $none,
                    $($ty::$v => $w,)+
                }
            }

            /// The value a word names; UNSPECIFIED for any other word.
            pub fn from_label(word: &str) -> $ty {
                match word {
                    $($w => $ty::$v,)+
                    _ => $ty::Unspecified,
                }
            }

            /// Position in [`Self::KNOWN`] (the slot of a counter array
            /// in label order); none for UNSPECIFIED, which has no series.
            pub fn position(self) -> Option<usize> {
                Self::KNOWN.iter().position(|k| *k == self)
            }
        }
    };
}

labels!(ShedCause, unspecified = "other", {
    PoolFull => "pool_full",
    TenantFull => "tenant_full",
    NoWait => "no_wait",
    MaxWait => "max_wait",
});

labels!(TokenizeMode, unspecified = "", {
    Tokenizer => "tokenizer",
    Render => "render",
    Approx => "approx",
    TokenIds => "token_ids",
});

labels!(LimitedBy, unspecified = "", {
    Requests => "requests",
    PromptTokens => "prompt_tokens",
    CompletionTokens => "completion_tokens",
    Tokens => "tokens",
    Concurrent => "concurrent",
    TooLarge => "too_large",
    Store => "store",
});

labels!(Decision, unspecified = "", {
    Prefix => "prefix",
    Load => "load",
    NoIndex => "no_index",
    AllSaturated => "all_saturated",
    NoEndpoints => "no_endpoints",
    Response => "response",
    UnknownResponse => "unknown_response",
    RateLimited => "rate_limited",
    Shed => "shed",
});

impl From<&Refusal> for LimitedBy {
    fn from(r: &Refusal) -> LimitedBy {
        match r {
            Refusal::Limited { dimension, .. } => match dimension {
                Dimension::Requests => LimitedBy::Requests,
                Dimension::PromptTokens => LimitedBy::PromptTokens,
                Dimension::CompletionTokens => LimitedBy::CompletionTokens,
                Dimension::TotalTokens => LimitedBy::Tokens,
            },
            Refusal::Concurrency { .. } => LimitedBy::Concurrent,
            Refusal::TooLarge { .. } => LimitedBy::TooLarge,
        }
    }
}

/// The enum when set, else the one the word names (UNSPECIFIED for an
/// empty or unknown word).
fn resolved<T: Copy + PartialEq>(value: T, none: T, word: &str, parse: fn(&str) -> T) -> T {
    if value == none {
        parse(word)
    } else {
        value
    }
}

impl PickResponse {
    /// The decision, from an indexer that sent only `reason` too.
    pub fn resolved_decision(&self) -> Decision {
        let d = self.decision();
        resolved(d, Decision::Unspecified, &self.reason, Decision::from_label)
    }

    /// Why the pick was shed (UNSPECIFIED when not shed or not known).
    pub fn resolved_cause(&self) -> ShedCause {
        let c = self.cause();
        resolved(
            c,
            ShedCause::Unspecified,
            &self.shed_cause,
            ShedCause::from_label,
        )
    }

    /// How the prompt was tokenized.
    pub fn resolved_tokenized_by(&self) -> TokenizeMode {
        let m = self.tokenized_by();
        let word = &self.tokenize_mode;
        resolved(m, TokenizeMode::Unspecified, word, TokenizeMode::from_label)
    }

    /// Sets the decision and its word.
    pub fn set_decision_and_reason(&mut self, d: Decision) {
        self.set_decision(d);
        self.reason = d.as_label().to_string();
    }

    /// Sets why the pick was shed and its word.
    pub fn set_shed_cause(&mut self, c: ShedCause) {
        self.set_cause(c);
        self.shed_cause = word_of(c.as_label(), c == ShedCause::Unspecified);
    }

    /// Sets how the prompt was tokenized and its word.
    pub fn set_tokenize_mode(&mut self, m: TokenizeMode) {
        self.set_tokenized_by(m);
        self.tokenize_mode = m.as_label().to_string();
    }
}

impl PoolStateResponse {
    /// The pool's tokenizer mode.
    pub fn resolved_tokenized_by(&self) -> TokenizeMode {
        let m = self.tokenized_by();
        let word = &self.tokenize_mode;
        resolved(m, TokenizeMode::Unspecified, word, TokenizeMode::from_label)
    }

    /// Sets the pool's tokenizer mode and its word.
    pub fn set_tokenize_mode(&mut self, m: TokenizeMode) {
        self.set_tokenized_by(m);
        self.tokenize_mode = m.as_label().to_string();
    }
}

impl BudgetStatus {
    /// The limit that refused the pick (UNSPECIFIED when admitted or not
    /// known).
    pub fn resolved_refused_by(&self) -> LimitedBy {
        let l = self.refused_by();
        resolved(
            l,
            LimitedBy::Unspecified,
            &self.limited_by,
            LimitedBy::from_label,
        )
    }

    /// Sets the limit that refused the pick and its word.
    pub fn set_limited_by(&mut self, l: LimitedBy) {
        self.set_refused_by(l);
        self.limited_by = l.as_label().to_string();
    }
}

/// The word written beside an enum: empty for UNSPECIFIED, as before the
/// enum existed.
fn word_of(label: &str, unspecified: bool) -> String {
    if unspecified {
        String::new()
    } else {
        label.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_unknown_words_are_unspecified() {
        for c in ShedCause::KNOWN {
            assert_eq!(ShedCause::from_label(c.as_label()), c);
        }
        for m in TokenizeMode::KNOWN {
            assert_eq!(TokenizeMode::from_label(m.as_label()), m);
        }
        for l in LimitedBy::KNOWN {
            assert_eq!(LimitedBy::from_label(l.as_label()), l);
        }
        for d in Decision::KNOWN {
            assert_eq!(Decision::from_label(d.as_label()), d);
        }
        assert_eq!(
            ShedCause::from_label("from the future"),
            ShedCause::Unspecified
        );
        assert_eq!(ShedCause::Unspecified.as_label(), "other");
        assert_eq!(LimitedBy::from_label(""), LimitedBy::Unspecified);
        assert_eq!(ShedCause::MaxWait.position(), Some(3));
        assert_eq!(ShedCause::Unspecified.position(), None);
    }

    #[test]
    fn the_words_are_the_ones_dashboards_match() {
        let words = |l: &[&str]| l.join(",");
        let shed: Vec<_> = ShedCause::KNOWN.iter().map(|c| c.as_label()).collect();
        assert_eq!(words(&shed), "pool_full,tenant_full,no_wait,max_wait");
        let modes: Vec<_> = TokenizeMode::KNOWN.iter().map(|m| m.as_label()).collect();
        assert_eq!(words(&modes), "tokenizer,render,approx,token_ids");
        let limits: Vec<_> = LimitedBy::KNOWN.iter().map(|l| l.as_label()).collect();
        assert_eq!(
            words(&limits),
            "requests,prompt_tokens,completion_tokens,tokens,concurrent,too_large,store"
        );
    }

    #[test]
    fn readers_take_the_enum_else_the_word_of_an_older_indexer() {
        let mut new = PickResponse::default();
        new.set_shed_cause(ShedCause::MaxWait);
        new.set_decision_and_reason(Decision::Shed);
        new.set_tokenize_mode(TokenizeMode::Approx);
        assert_eq!(
            (
                new.shed_cause.as_str(),
                new.reason.as_str(),
                new.tokenize_mode.as_str()
            ),
            ("max_wait", "shed", "approx")
        );
        let old = PickResponse {
            shed_cause: "pool_full".into(),
            reason: "shed".into(),
            tokenize_mode: "render".into(),
            ..Default::default()
        };
        assert_eq!(old.resolved_cause(), ShedCause::PoolFull);
        assert_eq!(old.resolved_decision(), Decision::Shed);
        assert_eq!(old.resolved_tokenized_by(), TokenizeMode::Render);
        assert_eq!(new.resolved_cause(), ShedCause::MaxWait);
        // A value from a newer indexer reads as UNSPECIFIED, never a panic.
        let newer = PickResponse {
            cause: 99,
            ..Default::default()
        };
        assert_eq!(newer.resolved_cause(), ShedCause::Unspecified);
        let mut admitted = PickResponse::default();
        admitted.set_shed_cause(ShedCause::Unspecified);
        assert!(admitted.shed_cause.is_empty());
    }

    #[test]
    fn budget_refusals_name_their_limit() {
        let r = Refusal::Limited {
            dimension: Dimension::PromptTokens,
            retry_after_ms: 1,
        };
        assert_eq!(LimitedBy::from(&r), LimitedBy::PromptTokens);
        let mut s = BudgetStatus::default();
        s.set_limited_by(LimitedBy::from(&Refusal::Concurrency { limit: 1 }));
        assert_eq!(
            (s.limited_by.as_str(), s.refused_by()),
            ("concurrent", LimitedBy::Concurrent)
        );
        let old = BudgetStatus {
            limited_by: "store".into(),
            ..Default::default()
        };
        assert_eq!(old.resolved_refused_by(), LimitedBy::Store);
    }
}
