//! The synthetic multi-tenant chat workload: tenants with their own long
//! system prompts, conversations that grow turn by turn, think times
//! between turns. Everything is planned up front from a seed, so every
//! routing mode replays exactly the same conversations.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Common English words; each is one token in byte-level BPE vocabularies
/// like Qwen3's (with its leading space), so a text of n words is about n
/// tokens.
pub(crate) const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "time",
    "people",
    "year",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "name",
    "team",
    "minute",
    "idea",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "good",
    "new",
    "first",
    "last",
    "long",
    "great",
    "little",
    "own",
    "other",
    "old",
    "big",
    "high",
    "different",
    "small",
    "large",
    "next",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "same",
    "able",
    "make",
    "know",
    "take",
    "see",
    "come",
    "think",
    "look",
    "want",
    "give",
    "use",
    "find",
    "tell",
    "ask",
    "seem",
    "feel",
    "try",
    "leave",
    "call",
    "model",
    "cache",
    "request",
    "token",
    "server",
    "data",
    "file",
    "code",
];

/// Shape of the workload. Token counts are in words (about one token each).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatConfig {
    /// Number of tenants, each with its own system prompt.
    pub tenants: usize,
    /// Tenant popularity skew: tenant i is chosen with weight 1/(i+1)^skew
    /// (0 = uniform).
    pub tenant_skew: f64,
    /// System prompt length range (inclusive), words.
    pub system_words: (usize, usize),
    /// Turns per conversation (inclusive).
    pub turns: (usize, usize),
    /// User message length range, words.
    pub user_words: (usize, usize),
    /// Completion length range, tokens.
    pub output_tokens: (u32, u32),
    /// Mean think time between a reply and the next turn, simulated
    /// seconds (exponentially distributed).
    pub think_s: f64,
    /// New conversations per simulated second (Poisson arrivals).
    pub conversations_per_s: f64,
    /// Arrivals stop after this many simulated seconds.
    pub duration_s: f64,
    /// Seed of everything random.
    pub seed: u64,
}

impl Default for ChatConfig {
    fn default() -> Self {
        ChatConfig {
            tenants: 8,
            tenant_skew: 0.5,
            system_words: (1500, 3000),
            turns: (3, 8),
            user_words: (100, 400),
            output_tokens: (100, 300),
            think_s: 8.0,
            conversations_per_s: 1.0,
            duration_s: 60.0,
            seed: 7,
        }
    }
}

/// A bad workload configuration.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{field}: {message}")]
pub struct ChatConfigError {
    /// The offending setting.
    pub field: &'static str,
    /// What is wrong.
    pub message: String,
}

impl ChatConfig {
    /// Checks the ranges and rates.
    pub fn validate(&self) -> Result<(), ChatConfigError> {
        let err = |field, message: String| Err(ChatConfigError { field, message });
        if self.tenants == 0 {
            return err("tenants", "must be at least 1".into());
        }
        for (field, (lo, hi)) in [
            ("system_words", self.system_words),
            ("turns", self.turns),
            ("user_words", self.user_words),
        ] {
            if lo == 0 || lo > hi {
                return err(field, format!("need 1 <= min <= max, got {lo}..{hi}"));
            }
        }
        let (lo, hi) = self.output_tokens;
        if lo == 0 || lo > hi {
            return err(
                "output_tokens",
                format!("need 1 <= min <= max, got {lo}..{hi}"),
            );
        }
        for (field, v) in [("think_s", self.think_s), ("tenant_skew", self.tenant_skew)] {
            if !(v.is_finite() && v >= 0.0) {
                return err(field, format!("must be >= 0, got {v}"));
            }
        }
        for (field, v) in [
            ("conversations_per_s", self.conversations_per_s),
            ("duration_s", self.duration_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return err(field, format!("must be > 0, got {v}"));
            }
        }
        Ok(())
    }
}

/// One turn: what the user says, how long the answer is, and how long the
/// user thinks after it before the next turn.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The user message.
    pub user: String,
    /// Completion tokens the engine is asked for.
    pub output_tokens: u32,
    /// Think time after this turn's answer, simulated seconds.
    pub think_s: f64,
}

/// One conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// Index in the plan.
    pub id: usize,
    /// Tenant index.
    pub tenant: usize,
    /// Arrival of the first turn, simulated seconds from the start.
    pub arrival_s: f64,
    /// The turns in order.
    pub turns: Vec<Turn>,
}

/// The whole planned workload.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatPlan {
    /// System prompt of each tenant.
    pub system_prompts: Vec<String>,
    /// Conversations by arrival time.
    pub conversations: Vec<Conversation>,
}

impl ChatPlan {
    /// Requests the plan will send.
    pub fn requests(&self) -> usize {
        self.conversations.iter().map(|c| c.turns.len()).sum()
    }
}

/// The tenant name the benchmark sends for tenant index `i`.
pub fn tenant_name(i: usize) -> String {
    format!("t{i:02}")
}

/// `n` words drawn from a fixed list (about one token each).
pub(crate) fn words(rng: &mut StdRng, n: usize) -> String {
    let mut s = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

fn exp(rng: &mut StdRng, mean: f64) -> f64 {
    if mean == 0.0 {
        return 0.0;
    }
    // 1 - u is in (0, 1], so the log is finite.
    -mean * (1.0 - rng.random::<f64>()).ln()
}

/// Plans the workload. Deterministic in the config.
pub fn plan(cfg: &ChatConfig) -> Result<ChatPlan, ChatConfigError> {
    cfg.validate()?;
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let system_prompts = (0..cfg.tenants)
        .map(|t| {
            let n = rng.random_range(cfg.system_words.0..=cfg.system_words.1);
            format!(
                "You are the assistant of tenant {}. Follow its house rules. {}",
                tenant_name(t),
                words(&mut rng, n)
            )
        })
        .collect();
    let weights: Vec<f64> = (0..cfg.tenants)
        .map(|i| 1.0 / ((i + 1) as f64).powf(cfg.tenant_skew))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut conversations = Vec::new();
    let mut t = exp(&mut rng, 1.0 / cfg.conversations_per_s);
    while t < cfg.duration_s {
        let mut x = rng.random::<f64>() * total;
        let mut tenant = cfg.tenants - 1;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                tenant = i;
                break;
            }
            x -= w;
        }
        let n = rng.random_range(cfg.turns.0..=cfg.turns.1);
        let id = conversations.len();
        let turns = (0..n)
            .map(|k| {
                let w = rng.random_range(cfg.user_words.0..=cfg.user_words.1);
                Turn {
                    user: format!("Conversation {id}, question {k}: {}", words(&mut rng, w)),
                    output_tokens: rng.random_range(cfg.output_tokens.0..=cfg.output_tokens.1),
                    think_s: exp(&mut rng, cfg.think_s),
                }
            })
            .collect();
        conversations.push(Conversation {
            id,
            tenant,
            arrival_s: t,
            turns,
        });
        t += exp(&mut rng, 1.0 / cfg.conversations_per_s);
    }
    Ok(ChatPlan {
        system_prompts,
        conversations,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_are_deterministic_and_within_ranges() {
        let cfg = ChatConfig {
            conversations_per_s: 2.0,
            duration_s: 100.0,
            ..ChatConfig::default()
        };
        let a = plan(&cfg).unwrap();
        assert_eq!(a, plan(&cfg).unwrap());
        assert_eq!(a.system_prompts.len(), 8);
        // Poisson: ~200 conversations.
        assert!(
            (150..250).contains(&a.conversations.len()),
            "{}",
            a.conversations.len()
        );
        let mut last = 0.0;
        for c in &a.conversations {
            assert!(c.arrival_s >= last && c.arrival_s < 100.0);
            last = c.arrival_s;
            assert!((3..=8).contains(&c.turns.len()));
            for t in &c.turns {
                assert!((100..=300).contains(&t.output_tokens));
                assert!(t.think_s >= 0.0);
            }
        }
        for s in &a.system_prompts {
            let n = s.split(' ').count();
            assert!((1500..3020).contains(&n), "{n}");
        }
        let b = plan(&ChatConfig { seed: 8, ..cfg }).unwrap();
        assert_ne!(a.system_prompts, b.system_prompts);
    }

    #[test]
    fn skew_favours_the_first_tenants_and_zero_is_uniform() {
        let count = |skew: f64| {
            let p = plan(&ChatConfig {
                tenant_skew: skew,
                conversations_per_s: 20.0,
                duration_s: 200.0,
                ..ChatConfig::default()
            })
            .unwrap();
            let mut n = [0usize; 8];
            for c in &p.conversations {
                n[c.tenant] += 1;
            }
            n
        };
        let skewed = count(1.0);
        assert!(skewed[0] > 3 * skewed[7], "{skewed:?}");
        let flat = count(0.0);
        let (lo, hi) = (flat.iter().min().unwrap(), flat.iter().max().unwrap());
        assert!(*hi < lo * 3 / 2, "{flat:?}");
    }

    #[test]
    fn bad_configs_name_the_setting() {
        let e = plan(&ChatConfig {
            turns: (5, 2),
            ..ChatConfig::default()
        })
        .unwrap_err();
        assert_eq!(e.field, "turns");
        let e = ChatConfig {
            conversations_per_s: 0.0,
            ..ChatConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.to_string(), "conversations_per_s: must be > 0, got 0");
    }
}
