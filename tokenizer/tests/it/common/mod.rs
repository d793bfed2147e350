//! Shared by the integration tests: where the Qwen3 files are, loaded
//! tokenizers (once per test binary), and a deterministic varied corpus.

#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use kvasir_tokenizer::reference::ReferenceTokenizer;
use kvasir_tokenizer::ChatTokenizer;

/// `KVASIR_TOKENIZER_DIR`, or the workspace's `.tools/tokenizers/qwen3`.
pub fn tokenizer_dir() -> PathBuf {
    let dir = std::env::var_os("KVASIR_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/tokenizers/qwen3")
        });
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        assert!(
            dir.join(file).is_file(),
            "the Qwen3 tokenizer file {} is missing: run `make setup` \
             (or `bash scripts/setup.sh`), or point KVASIR_TOKENIZER_DIR at a directory \
             holding tokenizer.json and tokenizer_config.json",
            dir.join(file).display()
        );
    }
    dir
}

pub static FAST: LazyLock<ChatTokenizer> =
    LazyLock::new(|| ChatTokenizer::from_dir(tokenizer_dir()).expect("load fast tokenizer"));

pub static REFERENCE: LazyLock<ReferenceTokenizer> = LazyLock::new(|| {
    ReferenceTokenizer::from_file(tokenizer_dir().join("tokenizer.json"))
        .expect("load reference tokenizer")
});

/// Asserts equal ids, and on failure shows where and on what text.
pub fn assert_same_ids(label: &str, text: &str, fast: &[u32], reference: &[u32]) {
    if fast == reference {
        return;
    }
    let at = fast
        .iter()
        .zip(reference)
        .position(|(a, b)| a != b)
        .unwrap_or(fast.len().min(reference.len()));
    let window = |ids: &[u32]| -> Vec<(u32, String)> {
        ids[at.saturating_sub(3)..(at + 4).min(ids.len())]
            .iter()
            .map(|&id| (id, FAST.decode(&[id])))
            .collect()
    };
    let before = FAST.decode(&reference[..at.min(reference.len())]);
    let ctx: String = before
        .chars()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    panic!(
        "{label}: ids differ at index {at} (fast {} ids, reference {} ids)\n\
         text before: {ctx:?}\n fast: {:?}\n  ref: {:?}\n text len {}",
        fast.len(),
        reference.len(),
        window(fast),
        window(reference),
        text.len()
    );
}

/// xorshift64*: deterministic, so a failing corpus is reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "tokenizer",
    "cache",
    "prefix",
    "router",
    "latency",
    "Paris",
    "HTTP",
    "vLLM",
    "KV",
    "don't",
    "I'LL",
    "we'Re",
    "it's",
    "They've",
    "she'd",
    "I'm",
    "O'Neil",
    "rock'n'roll",
    "'S",
    "'sup",
    "DON'T",
    "y'all",
    "'tis",
    "naïve",
    "café",
    "résumé",
    "Zürich",
    "straße",
    "İstanbul",
    "ſ",
    "'ſ",
    "ﬁne",
    "encyclopædia",
    "über",
    "Ünïcödé",
    "x",
    "a",
    "I",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "supercalifragilisticexpialidocious",
    "antidisestablishmentarianism",
    "e.g.",
    "i.e.",
];

const PUNCT: &[&str] = &[
    ".", ",", "!", "?", ";", ":", "...", " - ", " -- ", "—", "–", "(", ")", "[", "]", "{", "}",
    "\"", "'", "“", "”", "‘", "’", "«", "»", "/", "\\", "@", "#", "$", "%", "^", "&", "*", "_",
    "+", "=", "<", ">", "|", "~", "`", "!!", "?!", "...\n", ".\r\n", "::", "->", "=>",
];

const CODE: &[&str] = &[
    "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{x:?}\");\n}\n",
    "def encode(self, text: str) -> list[int]:\n\t\"\"\"Encode.\"\"\"\n\treturn [ord(c) for c in text]  # noqa\n",
    "if (a != b && c <= d || !e) { return -1; } else if (x >>= 2) {}\n",
    "#include <stdio.h>\nint main(void){printf(\"%d\\n\", 42);return 0;}\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%o%';\n",
    "    \n        nested:\n            - item: 1\n            - item: 2\n",
    "<div class=\"a\"><span>x &amp; y</span></div>\n",
    "const f = async (x) => { await fetch(`/api/${x}`); };\r\n",
    "x = [1,2,3]; y = {'k': (4, 5)}; z = x[::-1]\n",
    "\t\t\tindent\twith\ttabs\n",
    "// TODO(kvasir): handle the case where n == 0\n/* block\n * comment */\n",
    "$ cargo test -p kvasir-tokenizer --release -- --nocapture 2>&1 | tee log.txt\n",
];

const CJK_AND_SCRIPTS: &[&str] = &[
    "你好，世界！这是一个测试。",
    "東京都は日本の首都です。ひらがな、カタカナ、ｶﾀｶﾅ。",
    "한국어 텍스트입니다. 안녕하세요!",
    "\u{1100}\u{1161}\u{11A8}\u{1102}\u{1161}", // decomposed Hangul: NFC composes
    "Привет, мир! Ёлка — ёж.",
    "Γειά σου Κόσμε· ΑΒΓ αβγ ς",
    "مرحبا بالعالم، هذا اختبار.",
    "שלום עולם\u{200F}!",
    "हिन्दी भाषा में पाठ",
    "ภาษาไทยไม่มีช่องว่าง",
    "தமிழ் மொழி",
    "Tiếng Việt có dấu: ệ ữ ở",
    "ﾊﾝｶｸ ｶﾅ and ＦＵＬＬＷＩＤＴＨ １２３",
    "𝐀𝐁𝐂 𝒳𝒴 𐌰𐌱𐌲 𝟎𝟏𝟐",
];

const EMOJI: &[&str] = &[
    "😀",
    "👍🏽",
    "👨\u{200D}👩\u{200D}👧\u{200D}👦",
    "🇳🇴🇯🇵",
    "1\u{FE0F}\u{20E3}",
    "❤\u{FE0F}",
    "🤖🤖🤖",
    "🧪",
    "✨",
    "☃",
    "🫠",
    "🏳\u{FE0F}\u{200D}🌈",
];

const COMBINING: &[&str] = &[
    "e\u{301}",
    "a\u{30A}",
    "n\u{303}",
    "o\u{308}\u{304}",
    "\u{1E0B}\u{323}",
    "d\u{307}\u{323}",
    "A\u{30A}",
    "\u{212B}",
    "\u{2126}",
    "\u{F900}",
    "\u{0344}",
    "i\u{307}",
    "\u{0958}",
    "u\u{308}\u{301}",
    "e\u{323}\u{302}",
    "q\u{307}\u{323}",
    "\u{301}",
    "\u{301}\u{301}x",
    "a\u{0952}\u{0951}",
    "\u{0915}\u{093C}",
    "\u{05D1}\u{05BC}\u{05B0}",
];

const NUMBERS: &[&str] = &[
    "0",
    "42",
    "3.14159",
    "-17",
    "1,000,000",
    "1e-9",
    "2024-01-01T12:00:00Z",
    "0xDEADBEEF",
    "192.168.0.1",
    "+1 (555) 123-4567",
    "٣٤٥",
    "१२३",
    "²³",
    "½¾",
    "Ⅻ",
    "①②",
    "1234567890123",
    "$19.99",
    "50%",
    "v1.2.3-rc.4",
];

const SPACES: &[&str] = &[
    " ", "  ", "   ", "\t", " \t ", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", "\r", " \n",
    "  \n  ", "\t\n", "\u{A0}", "\u{3000}", "\u{2028}", "\u{85}", "\u{200B}", "\u{FEFF}", "\u{0B}",
    "\u{0C}", "\u{1C}", "\u{1F}", "\u{2009}", "\u{202F}", " \u{A0} ", "\u{1680}",
];

const SPECIALS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "<|im_start|",
    "<|im_",
    "<<|im_end|>>",
    "<|im_start|><|im_end|>",
    " <|im_start|> ",
    "<|fim_prefix|>",
    "<|vision_pad|>",
    "<|box_start|>x<|box_end|>",
    "<thinking>",
    "</think",
    "<|IM_START|>",
];

const ODD: &[&str] = &[
    "\u{0}",
    "\u{7}",
    "\u{7F}",
    "\u{E000}",
    "\u{F8FF}",
    "\u{FFFD}",
    "\u{FFFF}",
    "\u{10FFFF}",
    "\u{378}",
    "\u{10D40}\u{10D4A}",
    "\u{16100}",
    "∑∫√∞≠",
    "→⇒↔",
    "┌─┐│└┘",
    "€£¥₹₿",
    "™©®",
    "\u{E0061}\u{E0062}",
    "\u{1D11E}",
    "\u{FDFA}",
];

fn long_piece(rng: &mut Rng) -> String {
    let n = 100 + rng.below(3000);
    match rng.below(8) {
        0 => " ".repeat(n),
        1 => "a".repeat(n),
        2 => "ab".repeat(n / 2),
        3 => "=".repeat(n),
        4 => "\n".repeat(n / 10),
        5 => "🙂".repeat(n / 10),
        6 => (0..n / 4)
            .map(|i| {
                char::from(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz+/"[i * 7 % 54])
            })
            .collect(),
        _ => " \t".repeat(n / 2) + "x",
    }
}

fn json_blob(rng: &mut Rng) -> String {
    let mut s = String::from("{");
    for i in 0..1 + rng.below(6) {
        if i > 0 {
            s.push_str(rng.pick(&[",", ", ", ",\n  ", ",\r\n\t"]));
        }
        let key = rng.pick(WORDS);
        let val = match rng.below(5) {
            0 => format!("{}", rng.next() % 100_000),
            1 => format!("-{}.{}e{}", rng.below(100), rng.below(1000), rng.below(20)),
            2 => format!("\"{} {}\"", rng.pick(WORDS), rng.pick(CJK_AND_SCRIPTS)),
            3 => "[true, false, null, \"\\u00e9\\n\"]".to_string(),
            _ => "{\"nested\": {\"deep\": []}}".to_string(),
        };
        s.push_str(&format!("\"{key}\": {val}"));
    }
    s.push('}');
    s
}

/// About `target` bytes of mixed text, deterministic in `seed`.
pub fn document(seed: u64, target: usize) -> String {
    let mut rng = Rng::new(seed);
    let mut s = String::with_capacity(target + 4096);
    while s.len() < target {
        match rng.below(20) {
            0..=6 => {
                // A sentence of prose.
                for w in 0..3 + rng.below(15) {
                    if w > 0 {
                        s.push_str(rng.pick(&[" ", " ", " ", "  ", ", ", " (", "\u{A0}"]));
                    }
                    let word = rng.pick(WORDS);
                    match rng.below(6) {
                        0 => s.push_str(&word.to_uppercase()),
                        1 => {
                            let mut c = word.chars();
                            if let Some(f) = c.next() {
                                s.extend(f.to_uppercase());
                                s.push_str(c.as_str());
                            }
                        }
                        _ => s.push_str(word),
                    }
                }
                s.push_str(rng.pick(PUNCT));
            }
            7 => s.push_str(rng.pick(CODE)),
            8 => s.push_str(&json_blob(&mut rng)),
            9 | 10 => s.push_str(rng.pick(CJK_AND_SCRIPTS)),
            11 => s.push_str(rng.pick(EMOJI)),
            12 => s.push_str(rng.pick(COMBINING)),
            13 => s.push_str(rng.pick(NUMBERS)),
            14 | 15 => s.push_str(rng.pick(SPACES)),
            16 => s.push_str(rng.pick(SPECIALS)),
            17 => s.push_str(rng.pick(ODD)),
            18 if rng.below(8) == 0 => s.push_str(&long_piece(&mut rng)),
            _ => s.push_str(rng.pick(PUNCT)),
        }
        if rng.below(4) == 0 {
            s.push_str(rng.pick(SPACES));
        }
    }
    s
}
