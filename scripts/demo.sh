#!/usr/bin/env bash
# The local demo. Until the router stack lands it runs what exists: one
# vllm-sim, a two-turn chat against it (the second turn hits the prefix
# cache), a streamed reply, and the engine's metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/vllm-sim
PORT=${DEMO_PORT:-18000}
LOG=$(mktemp -t vllm-sim-demo.XXXXXX.log)
"$BIN" --port "$PORT" --enable-prompt-tokens-details --time-scale 1 2>"$LOG" &
PID=$!
cleanup() { kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; rm -f "$LOG"; }
trap cleanup EXIT INT TERM

for _ in $(seq 1 100); do
  curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 "$PID" 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.1
done
echo "== vllm-sim is up on 127.0.0.1:$PORT"
grep -m1 "vllm-sim ready" "$LOG" | sed 's/^.*INFO //'
echo
SYS="You are a meticulous assistant for a platform team. $(printf 'Always answer with care and precision. %.0s' $(seq 1 40))"
ask() {
  python3 - "$PORT" "$1" <<'PY'
import json, sys, time, urllib.request
port, body = sys.argv[1], sys.argv[2]
t0 = time.time()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body.encode(), headers={"content-type": "application/json"})
r = json.load(urllib.request.urlopen(req))
u = r["usage"]
print(f"   {time.time()-t0:6.3f}s  prompt={u['prompt_tokens']} cached={u['prompt_tokens_details']['cached_tokens']} completion={u['completion_tokens']}  -> {r['choices'][0]['message']['content'][:60]!r}")
PY
}
echo "== turn 1 (cold cache)"
ask "{\"model\":\"Qwen/Qwen3-8B\",\"max_tokens\":24,\"messages\":[{\"role\":\"system\",\"content\":\"$SYS\"},{\"role\":\"user\",\"content\":\"What is a KV cache?\"}]}"
echo "== turn 2 (same conversation, one more turn: its prefix is cached)"
ask "{\"model\":\"Qwen/Qwen3-8B\",\"max_tokens\":24,\"messages\":[{\"role\":\"system\",\"content\":\"$SYS\"},{\"role\":\"user\",\"content\":\"What is a KV cache?\"},{\"role\":\"assistant\",\"content\":\"It stores attention keys and values.\"},{\"role\":\"user\",\"content\":\"And prefix caching?\"}]}"
echo
echo "== a streamed reply (SSE, with usage)"
curl -sS -N "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"Qwen/Qwen3-8B","max_tokens":3,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Hi"}]}' 
echo
echo "== /metrics (vLLM names)"
curl -sS "http://127.0.0.1:$PORT/metrics" | grep -E '^vllm:(num_requests|kv_cache_usage|prefix_cache|time_to_first_token_seconds_(count|sum)|cache_config_info)' || true
