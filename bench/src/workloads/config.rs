//! The shapes' parameters, their documented defaults and their checks.

/// The shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Long-context conversations under large shared system prompts.
    LongChat,
    /// Agentic tool loops.
    Agents,
    /// Short prompts and long documents in bursts, little sharing.
    Bursty,
}

impl Shape {
    /// Every shape, in the order the benchmark runs them.
    pub const ALL: [Shape; 3] = [Shape::LongChat, Shape::Agents, Shape::Bursty];

    /// The workload's name in results (`<name>-<load>-<mode>.json`).
    pub fn name(self) -> &'static str {
        match self {
            Shape::LongChat => "longchat",
            Shape::Agents => "agents",
            Shape::Bursty => "bursty",
        }
    }

    /// The shape named `s`.
    pub fn parse(s: &str) -> Option<Shape> {
        Shape::ALL.into_iter().find(|x| x.name() == s)
    }
}

/// `longchat`'s parameters (token counts are words, about one token each).
#[derive(Debug, Clone, PartialEq)]
pub struct LongChatConfig {
    /// Distinct system prompts, each shared by many conversations (its
    /// index is the conversation's tenant).
    pub system_prompts: usize,
    /// System prompt popularity: prompt i is chosen with weight
    /// 1/(i+1)^skew.
    pub skew: f64,
    /// System prompt length, MIN..=MAX words.
    pub system_words: (usize, usize),
    /// Turns per conversation, MIN..=MAX (fewer where the context cap
    /// ends it).
    pub turns: (usize, usize),
    /// Share of turns that paste a document rather than ask a question.
    pub doc_share: f64,
    /// A pasted document's length, MIN..=MAX words.
    pub doc_words: (usize, usize),
    /// A question's length, MIN..=MAX words.
    pub question_words: (usize, usize),
    /// Answer length, MIN..=MAX tokens.
    pub output_tokens: (u32, u32),
    /// Mean pause between an answer and the next turn, simulated seconds
    /// (exponential).
    pub think_s: f64,
    /// A conversation stops before a turn that would take its context
    /// (prompt and answer, about tokens) past this.
    pub max_context_tokens: usize,
}

impl Default for LongChatConfig {
    fn default() -> Self {
        LongChatConfig {
            system_prompts: 4,
            skew: 1.0,
            system_words: (4000, 8000),
            turns: (3, 10),
            doc_share: 0.3,
            doc_words: (1500, 5000),
            question_words: (30, 300),
            output_tokens: (150, 600),
            think_s: 5.0,
            max_context_tokens: 30_000,
        }
    }
}

/// `agents`' parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentsConfig {
    /// Agent frameworks, each with its own system prompt (its index is
    /// the agent's tenant).
    pub kinds: usize,
    /// Framework popularity: kind i with weight 1/(i+1)^skew.
    pub skew: f64,
    /// System prompt with tool schemas, MIN..=MAX words.
    pub system_words: (usize, usize),
    /// The task statement, MIN..=MAX words.
    pub task_words: (usize, usize),
    /// Steps (requests) per agent, MIN..=MAX (fewer where the context
    /// cap ends it).
    pub steps: (usize, usize),
    /// A tool result, MIN..=MAX words, log-uniform.
    pub tool_words: (usize, usize),
    /// A tool call (the engine's answer), MIN..=MAX tokens.
    pub output_tokens: (u32, u32),
    /// Mean tool latency between an answer and the next step, simulated
    /// seconds (exponential).
    pub tool_s: f64,
    /// An agent stops before a step that would take its context past
    /// this (about tokens).
    pub max_context_tokens: usize,
}

impl Default for AgentsConfig {
    fn default() -> Self {
        AgentsConfig {
            kinds: 3,
            skew: 0.5,
            system_words: (3000, 6000),
            task_words: (200, 800),
            steps: (10, 50),
            tool_words: (50, 1500),
            output_tokens: (30, 150),
            tool_s: 1.5,
            max_context_tokens: 32_000,
        }
    }
}

/// `bursty`'s parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct BurstyConfig {
    /// Clients, each opening its requests with its own short preamble
    /// (its index is the request's tenant; chosen uniformly).
    pub clients: usize,
    /// A client's preamble (system message), MIN..=MAX words.
    pub preamble_words: (usize, usize),
    /// A short prompt, MIN..=MAX words, log-uniform.
    pub short_words: (usize, usize),
    /// Share of requests that carry a long document.
    pub long_share: f64,
    /// A long document, MIN..=MAX words, uniform.
    pub long_words: (usize, usize),
    /// Answer to a short prompt, MIN..=MAX tokens.
    pub short_output: (u32, u32),
    /// Answer to a document, MIN..=MAX tokens.
    pub long_output: (u32, u32),
    /// Mean length of a burst, simulated seconds (exponential).
    pub on_s: f64,
    /// Mean length of a quiet spell, simulated seconds (exponential).
    pub off_s: f64,
    /// Arrival rate in a burst over the rate in a quiet spell (1: plain
    /// Poisson).
    pub peak_over_quiet: f64,
}

impl Default for BurstyConfig {
    fn default() -> Self {
        BurstyConfig {
            clients: 4,
            preamble_words: (20, 60),
            short_words: (200, 1000),
            long_share: 0.04,
            long_words: (20_000, 60_000),
            short_output: (50, 300),
            long_output: (200, 600),
            on_s: 3.0,
            off_s: 9.0,
            peak_over_quiet: 8.0,
        }
    }
}

/// One shape with its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum ShapeConfig {
    /// `longchat`.
    LongChat(LongChatConfig),
    /// `agents`.
    Agents(AgentsConfig),
    /// `bursty`.
    Bursty(BurstyConfig),
}

impl ShapeConfig {
    /// The shape's documented defaults.
    pub fn default_for(shape: Shape) -> ShapeConfig {
        match shape {
            Shape::LongChat => ShapeConfig::LongChat(LongChatConfig::default()),
            Shape::Agents => ShapeConfig::Agents(AgentsConfig::default()),
            Shape::Bursty => ShapeConfig::Bursty(BurstyConfig::default()),
        }
    }

    /// Which shape.
    pub fn shape(&self) -> Shape {
        match self {
            ShapeConfig::LongChat(_) => Shape::LongChat,
            ShapeConfig::Agents(_) => Shape::Agents,
            ShapeConfig::Bursty(_) => Shape::Bursty,
        }
    }
}

/// A workload to plan: a shape, its rate and window, a seed.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadConfig {
    /// The shape and its parameters.
    pub shape: ShapeConfig,
    /// Sessions started per simulated second, on average (a `bursty`
    /// session is one request).
    pub rate: f64,
    /// Sessions start within this many simulated seconds.
    pub duration_s: f64,
    /// Seed of everything random.
    pub seed: u64,
}

impl WorkloadConfig {
    /// `shape` with its documented parameters.
    pub fn new(shape: Shape, rate: f64, duration_s: f64, seed: u64) -> WorkloadConfig {
        WorkloadConfig {
            shape: ShapeConfig::default_for(shape),
            rate,
            duration_s,
            seed,
        }
    }
}

/// A setting out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct WorkloadError {
    /// The setting.
    pub field: &'static str,
    /// What is wrong.
    pub message: String,
}

fn bad<T>(field: &'static str, message: String) -> Result<T, WorkloadError> {
    Err(WorkloadError { field, message })
}

fn range<T: PartialOrd + Copy + Default + std::fmt::Display>(
    field: &'static str,
    (lo, hi): (T, T),
) -> Result<(), WorkloadError> {
    if lo <= T::default() || lo > hi {
        return bad(field, format!("need 1 <= min <= max, got {lo}..{hi}"));
    }
    Ok(())
}

fn positive(field: &'static str, v: f64) -> Result<(), WorkloadError> {
    if !(v.is_finite() && v > 0.0) {
        return bad(field, format!("must be > 0, got {v}"));
    }
    Ok(())
}

fn non_negative(field: &'static str, v: f64) -> Result<(), WorkloadError> {
    if !(v.is_finite() && v >= 0.0) {
        return bad(field, format!("must be >= 0, got {v}"));
    }
    Ok(())
}

fn share(field: &'static str, v: f64) -> Result<(), WorkloadError> {
    if !(0.0..=1.0).contains(&v) {
        return bad(field, format!("must be within 0..=1, got {v}"));
    }
    Ok(())
}

fn count(field: &'static str, n: usize) -> Result<(), WorkloadError> {
    // Tenants are t00..t15 in the benchmark's policy.
    if !(1..=16).contains(&n) {
        return bad(field, format!("must be within 1..=16, got {n}"));
    }
    Ok(())
}

impl WorkloadConfig {
    /// Checks every setting.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        positive("rate", self.rate)?;
        positive("duration_s", self.duration_s)?;
        match &self.shape {
            ShapeConfig::LongChat(c) => {
                count("system_prompts", c.system_prompts)?;
                non_negative("skew", c.skew)?;
                range("system_words", c.system_words)?;
                range("turns", c.turns)?;
                share("doc_share", c.doc_share)?;
                range("doc_words", c.doc_words)?;
                range("question_words", c.question_words)?;
                range("output_tokens", c.output_tokens)?;
                non_negative("think_s", c.think_s)?;
                if c.max_context_tokens <= c.system_words.1 {
                    return bad(
                        "max_context_tokens",
                        "must exceed the longest system prompt".into(),
                    );
                }
            }
            ShapeConfig::Agents(c) => {
                count("kinds", c.kinds)?;
                non_negative("skew", c.skew)?;
                range("system_words", c.system_words)?;
                range("task_words", c.task_words)?;
                range("steps", c.steps)?;
                range("tool_words", c.tool_words)?;
                range("output_tokens", c.output_tokens)?;
                non_negative("tool_s", c.tool_s)?;
                if c.max_context_tokens <= c.system_words.1 + c.task_words.1 {
                    return bad(
                        "max_context_tokens",
                        "must exceed the longest system prompt and task".into(),
                    );
                }
            }
            ShapeConfig::Bursty(c) => {
                count("clients", c.clients)?;
                range("preamble_words", c.preamble_words)?;
                range("short_words", c.short_words)?;
                share("long_share", c.long_share)?;
                range("long_words", c.long_words)?;
                range("short_output", c.short_output)?;
                range("long_output", c.long_output)?;
                positive("on_s", c.on_s)?;
                positive("off_s", c.off_s)?;
                if !(c.peak_over_quiet.is_finite() && c.peak_over_quiet >= 1.0) {
                    return bad(
                        "peak_over_quiet",
                        format!("must be >= 1, got {}", c.peak_over_quiet),
                    );
                }
            }
        }
        Ok(())
    }
}
