//! Command-line flags. Names follow `vllm serve` where vLLM has the knob.

use crate::kv_events::{EventEncoding, HashFormat};
use crate::latency::LatencyProfile;
use crate::waiting::SchedulingPolicy;
use clap::Parser;
use std::path::PathBuf;

/// `--max-num-batched-tokens` when not given.
pub use vllm_latency::DEFAULT_MAX_NUM_BATCHED_TOKENS;
/// `--profile` when not given.
pub use vllm_latency::DEFAULT_PROFILE;

/// A simulated vLLM instance: vLLM's OpenAI API, KV-cache events over ZMQ and
/// Prometheus metrics, with a prefix cache and a continuous-batching
/// scheduler priced by a latency model. One process is one engine.
#[derive(Debug, Clone, Parser)]
#[command(name = "vllm-sim", version, about, long_about = None)]
pub struct Args {
    /// Address to serve HTTP on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Served model name.
    #[arg(long, default_value = "Qwen/Qwen3-8B")]
    pub model: String,
    /// Folder with the model's tokenizer.json and tokenizer_config.json
    /// (default: $KVASIR_TOKENIZER_DIR, else .tools/tokenizers/qwen3 found
    /// from the working directory or the binary's location upward).
    #[arg(long, env = "KVASIR_TOKENIZER_DIR")]
    pub tokenizer: Option<PathBuf>,

    // ---- cache and scheduler (vLLM's names) ----
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV-cache capacity in blocks (vLLM: --num-gpu-blocks-override).
    /// 25,000 blocks of 16 is what an 8B model leaves free on an 80 GB H100.
    #[arg(
        long,
        visible_alias = "num-gpu-blocks-override",
        default_value_t = 25_000
    )]
    pub num_gpu_blocks: usize,
    /// Most sequences in one batch.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one step (chunked prefill splits longer prompts).
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus completion, in tokens.
    #[arg(long, default_value_t = 40_960)]
    pub max_model_len: usize,
    /// Root of the block-hash chains (vLLM's NONE_HASH). Default: from
    /// $PYTHONHASHSEED if set, else random per process, as in vLLM, so two
    /// engines publish different hashes for the same prefix.
    #[arg(long)]
    pub block_hash_seed: Option<u64>,
    /// Turn the prefix cache off.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Waiting-queue order: fcfs (arrival order, vLLM's default) or
    /// priority (the request's `priority` field or X-Vllm-Priority header,
    /// lower first; under KV pressure the lowest-priority, latest running
    /// request is preempted).
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,
    /// Report usage.prompt_tokens_details.cached_tokens, as vLLM does with
    /// this flag.
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,
    /// Completion length when a request gives neither max_tokens nor the
    /// x-sim-output-tokens header (the synthetic model "stops" there).
    #[arg(long, default_value_t = 32)]
    pub default_output_tokens: u32,

    // ---- latency model ----
    /// Latency profile: h100-8b (default, FACTS.md calibration),
    /// llmd-8b-h100 (llm-d-inference-sim's, ~8x slower prefill), zero.
    #[arg(long, default_value = DEFAULT_PROFILE, value_parser = clap::builder::PossibleValuesParser::new(LatencyProfile::NAMES))]
    pub profile: String,
    /// Wall seconds per simulated second: 1 real time, 0.1 ten times
    /// faster, 0 as fast as the CPU allows. Latency metrics stay in
    /// simulated seconds.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Override: fixed cost of a step with prefill, ms.
    #[arg(long)]
    pub prefill_overhead_ms: Option<f64>,
    /// Override: prefill cost per uncached token, us.
    #[arg(long)]
    pub prefill_per_token_us: Option<f64>,
    /// Override: attention cost per (new token x earlier token), ns.
    #[arg(long)]
    pub prefill_attn_per_pair_ns: Option<f64>,
    /// Override: fixed cost of every step (weights read), ms.
    #[arg(long)]
    pub step_base_ms: Option<f64>,
    /// Override: cost per sequence in a step, us.
    #[arg(long)]
    pub per_seq_us: Option<f64>,
    /// Override: KV read cost per context token of a decoding sequence, ns.
    #[arg(long)]
    pub decode_per_ctx_token_ns: Option<f64>,

    // ---- KV events ----
    /// vLLM's --kv-events-config JSON (endpoint, replay_endpoint, topic,
    /// buffer_steps, enable_kv_cache_events); `*` in an endpoint means --host.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// KV-events PUB port (0 = a free one, logged and shown at /sim/info).
    #[arg(long, default_value_t = 0)]
    pub kv_events_port: u16,
    /// KV-events ROUTER replay port (0 = a free one).
    #[arg(long, default_value_t = 0)]
    pub kv_events_replay_port: u16,
    /// Run without a replay socket.
    #[arg(long)]
    pub no_kv_events_replay: bool,
    /// Topic frame of every event message.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Batches kept for replay.
    #[arg(long, default_value_t = 10_000)]
    pub kv_events_buffer_steps: usize,
    /// Event layout: map (vLLM >= 0.23) or array (vLLM <= 0.22).
    #[arg(long, value_enum, default_value_t = EventEncoding::Map)]
    pub kv_events_encoding: EventEncoding,
    /// Block hash layout: int (uint64) or bytes (32-byte bin).
    #[arg(long, value_enum, default_value_t = HashFormat::Int)]
    pub kv_events_hash_format: HashFormat,
    /// data_parallel_rank written into each batch; as in vLLM, it also
    /// moves the KV-event ports (unless 0) up by the rank.
    #[arg(long, default_value_t = 0)]
    pub data_parallel_rank: u32,

    // ---- APIs ----
    /// Keep Responses API responses in memory for previous_response_id,
    /// GET and cancel (vLLM's env switch; off by default as in vLLM).
    #[arg(long, env = "VLLM_ENABLE_RESPONSES_API_STORE")]
    pub enable_responses_api_store: bool,
    /// Count in-flight requests for GET /load (vLLM's flag).
    #[arg(long)]
    pub enable_server_load_tracking: bool,

    // ---- faults (also changeable at run time: POST /sim/faults) ----
    /// Serve the admin endpoints that change the engine at run time:
    /// `GET`/`POST /sim/faults`, `POST /sim/clear-cache` and `POST
    /// /sim/restart-events`. Off, they answer 404: anyone who reaches the
    /// port could otherwise fail or stall every request. For tests only.
    /// The variable takes the usual spellings (1/0, true/false, yes/no, on/off).
    #[arg(long, env = "VLLM_SIM_ENABLE_ADMIN", value_parser = clap::builder::BoolishValueParser::new())]
    pub enable_sim_admin: bool,
    /// Fraction of requests answered with HTTP 500.
    #[arg(long, default_value_t = 0.0)]
    pub fault_fail_rate: f64,
    /// Fraction of KV-event batches silently not sent (gaps in sequence).
    #[arg(long, default_value_t = 0.0)]
    pub fault_drop_event_rate: f64,
    /// Start with /health answering 503.
    #[arg(long)]
    pub fault_unhealthy: bool,
}

/// The resolved KV-events settings.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsSettings {
    /// Events enabled at all.
    pub enabled: bool,
    /// PUB endpoint to bind.
    pub endpoint: String,
    /// ROUTER endpoint to bind.
    pub replay_endpoint: Option<String>,
    /// The PUB endpoint as vLLM advertises it in /kv_event_sources: as
    /// configured (a `*` host kept), the rank's port offset applied.
    pub advertised_endpoint: String,
    /// The replay endpoint as advertised.
    pub advertised_replay: Option<String>,
    /// Topic.
    pub topic: String,
    /// Replay buffer.
    pub buffer_steps: usize,
    /// vLLM's publisher high-water mark (reported, not enforced).
    pub hwm: u64,
    /// vLLM's publisher queue bound (reported, not enforced).
    pub max_queue_size: u64,
}

impl Args {
    /// The hash seed: the flag, else $PYTHONHASHSEED, else random.
    pub fn hash_seed(&self) -> crate::hashing::HashSeed {
        let env = std::env::var("PYTHONHASHSEED")
            .ok()
            .and_then(|v| v.parse::<u64>().ok());
        crate::hashing::HashSeed(self.block_hash_seed.or(env).unwrap_or_else(rand::random))
    }

    /// The latency profile with overrides applied.
    pub fn latency_profile(&self) -> Result<LatencyProfile, String> {
        let mut p = LatencyProfile::by_name(&self.profile)
            .ok_or_else(|| format!("unknown profile {}", self.profile))?;
        let set = |dst: &mut f64, v: Option<f64>, scale: f64, name: &str| -> Result<(), String> {
            if let Some(v) = v {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(format!("--{name} must be a non-negative number, got {v}"));
                }
                *dst = v * scale;
            }
            Ok(())
        };
        set(
            &mut p.prefill_overhead_us,
            self.prefill_overhead_ms,
            1000.0,
            "prefill-overhead-ms",
        )?;
        set(
            &mut p.prefill_per_token_us,
            self.prefill_per_token_us,
            1.0,
            "prefill-per-token-us",
        )?;
        set(
            &mut p.prefill_attn_per_pair_ns,
            self.prefill_attn_per_pair_ns,
            1.0,
            "prefill-attn-per-pair-ns",
        )?;
        set(
            &mut p.step_base_us,
            self.step_base_ms,
            1000.0,
            "step-base-ms",
        )?;
        set(&mut p.per_seq_us, self.per_seq_us, 1.0, "per-seq-us")?;
        set(
            &mut p.decode_per_ctx_token_us,
            self.decode_per_ctx_token_ns,
            0.001,
            "decode-per-ctx-token-ns",
        )?;
        Ok(p)
    }

    /// Checks values clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.block_size == 0 {
            return Err("--block-size must be positive".into());
        }
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            return Err(format!(
                "--time-scale must be >= 0, got {}",
                self.time_scale
            ));
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 || self.max_model_len < 2 {
            return Err("--max-num-seqs and --max-num-batched-tokens must be positive, --max-model-len at least 2".into());
        }
        if self.num_gpu_blocks * self.block_size < self.max_model_len {
            return Err(format!(
                "the KV cache ({} blocks x {} tokens = {} tokens) cannot hold one sequence of --max-model-len {}; lower --max-model-len or raise --num-gpu-blocks",
                self.num_gpu_blocks, self.block_size, self.num_gpu_blocks * self.block_size, self.max_model_len
            ));
        }
        for (n, r) in [
            ("fault-fail-rate", self.fault_fail_rate),
            ("fault-drop-event-rate", self.fault_drop_event_rate),
        ] {
            if !(0.0..=1.0).contains(&r) {
                return Err(format!("--{n} must be within [0, 1], got {r}"));
            }
        }
        self.latency_profile()?;
        self.kv_events()?;
        Ok(())
    }

    /// KV-events settings from the flags and, over them, --kv-events-config.
    pub fn kv_events(&self) -> Result<KvEventsSettings, String> {
        let endpoint = format!("tcp://{}:{}", self.host, self.kv_events_port);
        let replay_endpoint = (!self.no_kv_events_replay)
            .then(|| format!("tcp://{}:{}", self.host, self.kv_events_replay_port));
        let mut s = KvEventsSettings {
            enabled: true,
            advertised_endpoint: endpoint.clone(),
            advertised_replay: replay_endpoint.clone(),
            endpoint,
            replay_endpoint,
            topic: self.kv_events_topic.clone(),
            buffer_steps: self.kv_events_buffer_steps,
            hwm: 100_000,
            max_queue_size: 100_000,
        };
        if let Some(cfg) = &self.kv_events_config {
            let v: serde_json::Value = serde_json::from_str(cfg)
                .map_err(|e| format!("--kv-events-config is not valid JSON: {e}"))?;
            let obj = v
                .as_object()
                .ok_or("--kv-events-config must be a JSON object")?;
            let host = &self.host;
            let fix = |e: &str| e.replace("://*:", &format!("://{host}:"));
            for (k, val) in obj {
                match (k.as_str(), val) {
                    ("enable_kv_cache_events", serde_json::Value::Bool(b)) => s.enabled = *b,
                    ("publisher", serde_json::Value::String(p)) if p == "zmq" || p == "null" => {
                        s.enabled &= p == "zmq"
                    }
                    ("endpoint", serde_json::Value::String(e)) => {
                        s.endpoint = fix(e);
                        s.advertised_endpoint = e.clone();
                    }
                    ("replay_endpoint", serde_json::Value::String(e)) => {
                        s.replay_endpoint = Some(fix(e));
                        s.advertised_replay = Some(e.clone());
                    }
                    ("replay_endpoint", serde_json::Value::Null) => {
                        s.replay_endpoint = None;
                        s.advertised_replay = None;
                    }
                    ("topic", serde_json::Value::String(t)) => s.topic = t.clone(),
                    ("buffer_steps", serde_json::Value::Number(n)) => {
                        s.buffer_steps = n
                            .as_u64()
                            .ok_or("--kv-events-config.buffer_steps must be a positive integer")?
                            as usize
                    }
                    ("hwm" | "max_queue_size", serde_json::Value::Number(n)) => {
                        let n = n.as_u64().ok_or_else(|| {
                            format!("--kv-events-config.{k} must be a non-negative integer")
                        })?;
                        if k == "hwm" {
                            s.hwm = n;
                        } else {
                            s.max_queue_size = n;
                        }
                    }
                    ("hwm" | "max_queue_size" | "enable_kv_cache_events" | "publisher", _) => {
                        return Err(format!("--kv-events-config.{k} has the wrong type"));
                    }
                    _ => {
                        return Err(format!(
                            "--kv-events-config.{k} is not a known field or has the wrong type"
                        ))
                    }
                }
            }
        }
        if s.buffer_steps == 0 {
            return Err("kv-events buffer_steps must be positive".into());
        }
        let rank = self.data_parallel_rank;
        let offset = |e: &str| offset_endpoint_port(e, rank);
        s.endpoint = offset(&s.endpoint);
        s.advertised_endpoint = offset(&s.advertised_endpoint);
        s.replay_endpoint = s.replay_endpoint.as_deref().map(offset);
        s.advertised_replay = s.advertised_replay.as_deref().map(offset);
        Ok(s)
    }
}

/// An endpoint as vLLM's publisher advertises it: its configured form,
/// the port moved by the data-parallel rank (`offset_endpoint_port`).
pub fn offset_endpoint_port(endpoint: &str, dp_rank: u32) -> String {
    if dp_rank == 0 {
        return endpoint.to_string();
    }
    if endpoint.contains("inproc") {
        return format!("{endpoint}_dp{dp_rank}");
    }
    match endpoint.rsplit_once(':') {
        Some((base, port)) => match port.parse::<u64>() {
            Ok(0) | Err(_) => endpoint.to_string(),
            Ok(p) => format!("{base}:{}", p + u64::from(dp_rank)),
        },
        None => endpoint.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_move_with_the_rank_as_in_vllm() {
        assert_eq!(offset_endpoint_port("tcp://*:5557", 0), "tcp://*:5557");
        assert_eq!(offset_endpoint_port("tcp://*:5557", 2), "tcp://*:5559");
        assert_eq!(offset_endpoint_port("tcp://*:0", 2), "tcp://*:0");
        assert_eq!(
            offset_endpoint_port("inproc://cache", 1),
            "inproc://cache_dp1"
        );
    }

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["vllm-sim"];
        v.extend_from_slice(extra);
        Args::parse_from(v)
    }

    #[test]
    fn defaults_are_valid() {
        let a = args(&[]);
        a.validate().unwrap();
        assert_eq!(a.latency_profile().unwrap(), LatencyProfile::h100_8b());
    }

    #[test]
    fn the_admin_endpoints_are_off_unless_asked_for() {
        assert!(!args(&[]).enable_sim_admin);
        assert!(args(&["--enable-sim-admin"]).enable_sim_admin);
    }

    #[test]
    fn overrides_apply_with_units() {
        let a = args(&[
            "--prefill-overhead-ms",
            "10",
            "--decode-per-ctx-token-ns",
            "50",
        ]);
        let p = a.latency_profile().unwrap();
        assert_eq!(p.prefill_overhead_us, 10_000.0);
        assert!((p.decode_per_ctx_token_us - 0.05).abs() < 1e-12);
        assert!(args(&["--step-base-ms=-1"]).validate().is_err());
    }

    #[test]
    fn vllm_kv_events_config_is_understood() {
        let a = args(&[
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv-events"}"#,
        ]);
        let s = a.kv_events().unwrap();
        assert_eq!(s.endpoint, "tcp://127.0.0.1:5557");
        assert_eq!(s.replay_endpoint.as_deref(), Some("tcp://127.0.0.1:5558"));
        assert_eq!(s.topic, "kv-events");
        assert_eq!(s.advertised_endpoint, "tcp://*:5557");
        let ranked = args(&[
            "--data-parallel-rank",
            "2",
            "--kv-events-config",
            r#"{"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:0","hwm":7}"#,
        ])
        .kv_events()
        .unwrap();
        assert_eq!(ranked.endpoint, "tcp://127.0.0.1:5559");
        assert_eq!(ranked.advertised_endpoint, "tcp://*:5559");
        assert_eq!(ranked.advertised_replay.as_deref(), Some("tcp://*:0"));
        assert_eq!(ranked.hwm, 7);
        assert!(args(&["--kv-events-config", "{\"bogus\":1}"])
            .kv_events()
            .is_err());
        assert!(args(&["--kv-events-config", "[1"]).kv_events().is_err());
    }

    #[test]
    fn cache_must_hold_one_sequence() {
        let e = args(&["--num-gpu-blocks", "10"]).validate().unwrap_err();
        assert!(e.contains("max-model-len"), "{e}");
    }
}
