#!/bin/bash
# The benches of bench/RESULTS.md's "Quiet reruns" section, back to back, each output in OUT/<name>.txt
# with its command, start and end time and load average.   Usage: bench/run_all.sh [OUT] [PYTHON]
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:-bench-out}" && cd "${1:-bench-out}" && pwd)
P=${2:-python}
BIN=$(dirname "$(command -v "$P")")
cd "$ROOT"
run() { name=$1; shift; echo "== $name: $* (start $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))" > "$OUT/$name.txt"; ( time "$@" ) >> "$OUT/$name.txt" 2>&1; echo "== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/$name.txt"; }
# peers (ai-dynamo-runtime, sglang-router, vllm-router) come from bench/peers.py's cache venvs, made on first use
run kv "$P" -P bench/kv_index.py --events 200000 --queries 20000
run ingest "$P" bench/ingest_path.py --runs 3 --pods 4 --frames 6000 --seconds 8
run ingest-long "$P" -P bench/ingest_path.py --runs 3 --pods 4 --frames 30000 --seconds 4 --timeout 200
run ingest-steady "$P" -P bench/ingest_path.py --runs 3 --pods 4 --frames 30000 --capacity 250000 --seconds 4 --timeout 200 --encodings binary:per-pod,binary
run agreement "$P" bench/index_agreement.py
run router "$P" -P bench/router.py
run router-long "$P" -P bench/router.py --backends 8 --requests 1000 --prompt-chars 7400 --strategies kv-aware --peers sglang-router --peer-policies cache_aware --rounds 3
run tokenizer "$P" -P bench/tokenizer_speed.py
run kvsize "$P" -P bench/kv_query_size.py --queries 8000 --before-ref 5e5a381
run quality "$P" -P bench/routing_quality.py --time-scale 2 -p round-robin -p least-load -p dynamo-cost -p kv-aware -p kv-aware-prefill
run quality-http "$P" -P bench/routing_http.py --requests 400 --time-scale 8 --rounds 3 -r kv-aware -r sglang:cache_aware -r vllm:cache_aware --keep-kv "$OUT/kv.msgpack"
run router-feed "$P" -P bench/router_feed.py "$OUT/kv.msgpack" --rounds 3
run quality-http-busy "$P" -P bench/routing_http.py --requests 400 --time-scale 8 --rounds 2 --cpu-hog 2 -r kv-aware -r sglang:cache_aware
run ttft-floor "$P" -P bench/ttft_floor.py --live
run records "$P" -P bench/records_publish.py --rounds 5
run replica-sync "$P" -P bench/replica_sync.py
run bursts-trace "$P" -P bench/shared_prefix_trace.py --out "$OUT/bursts.jsonl"
run quality-http-bursts "$P" -P bench/routing_http.py --trace "$OUT/bursts.jsonl" --skip 0 --requests 400 --time-scale 4 --rounds 3 --replicas 2 -r kv-aware -r kv-aware+INFERNEX_ROUTER__REPLICA_SYNC_ROUTES=false
run quality-http-replicas "$P" -P bench/routing_http.py --requests 400 --time-scale 8 --rounds 3 --replicas 2 -r kv-aware -r kv-aware+INFERNEX_ROUTER__REPLICA_SYNC=false -r sglang:cache_aware
run router-long-hf "$P" -P bench/router.py --backends 8 --requests 1000 --prompt-chars 7400 --strategies kv-aware --peers sglang-router --peer-policies cache_aware --rounds 3 --router-tokenizer tests/fixtures/tokenize
run router-path "$P" -P bench/router_path.py --reps 5
run router-path-fresh-32k "$P" -P bench/router_path.py --reps 5 --fresh --requests 3000 --router-tokenizer "$("$P" -P bench/bench_tokenizer.py | cut -d' ' -f1)"
run router-stream "$P" -P bench/router_stream.py --rounds 3
run router-fresh-32k "$P" -P bench/router.py --backends 8 --requests 1000 --prompt-chars 7400 --strategies kv-aware --peers sglang-router --peer-policies cache_aware --rounds 3 --fresh --router-tokenizer "$("$P" -P bench/bench_tokenizer.py | cut -d' ' -f1)"
run router-fresh-32k-fast-ab "$P" -P bench/router.py --backends 8 --requests 1000 --prompt-chars 7400 --strategies "kv-aware,kv-aware+INFERNEX_ROUTER__TOKENIZER_FAST=false" --rounds 5 --fresh --router-tokenizer "$("$P" -P bench/bench_tokenizer.py | cut -d' ' -f1)"
run tokenizer-32k "$P" -P bench/tokenizer_speed.py --tokenizer "$("$P" -P bench/bench_tokenizer.py | cut -d' ' -f1)"
run simulate "$BIN/infernex" simulate --trace ../shared/traces/mooncake_synthetic_trace.jsonl -p round-robin -p least-load -p kv-aware -p dynamo-cost --out "$OUT/sim-out"
run kvsvc "$P" -P bench/kv_index.py --service --events 40000 --rate 1000
run kvlag "$P" -P bench/kv_index.py --service --events 2000 --rate 5000 --paced-workload steps
run replay "$P" -P bench/replay.py --messages 100000 --workers 1,2,4
(cd "$OUT" && run demo "$BIN/infernex" demo --out "$OUT/demo-out")
run prediction-tables "$P" -P bench/prediction_tables.py
