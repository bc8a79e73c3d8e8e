"""vLLM ``/metrics`` scraper -> :class:`schemas.EngineMetrics` on ``engine.metrics.<pod>``.

The text is read with prometheus_client's parser; one snapshot is built per
``(model_name, engine)`` label pair the engine reports. A target that cannot be reached
or read is reported (log line, ``infernex_metrics_scrape_errors_total``,
``infernex_metrics_target_up`` = 0, and :attr:`MetricsCollector.status`) and scraped
again next round; it never stops the collector.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from consumers import bus
from schemas import EngineMetrics, HistogramSnapshot
from schemas import subjects as S

log = logging.getLogger(__name__)

_GAUGES = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_perc",  # vLLM V0 name
}
_COUNTERS = {  # family names as the parser gives them (without _total)
    "vllm:prefix_cache_queries": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits": "prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries": "prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits": "prefix_cache_hits_total",
    "vllm:prompt_tokens": "prompt_tokens_total",
    "vllm:generation_tokens": "generation_tokens_total",
}
_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds": "inter_token_latency_seconds",  # older name
    "vllm:e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "request_queue_time_seconds",
}

_ENGINE_SERIES = {*_GAUGES.values(), *_COUNTERS.values()}


class MetricsParseError(ValueError):
    pass


def parse_vllm_metrics(text: str, pod: str, ts: float, *, role: str = "aggregated",
                       model: str | None = None) -> list[EngineMetrics]:
    """Snapshots of every ``(model_name, engine)`` found in a vLLM exposition."""
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # noqa: BLE001 - the parser raises plain ValueError/TypeError
        raise MetricsParseError(f"not Prometheus text exposition: {exc}") from None
    snaps: dict[tuple[str, str], dict] = {}
    cache_info: dict[str | None, dict[str, int]] = {}

    def slot(labels: dict) -> dict:
        key = (labels.get("model_name") or model or "unknown", labels.get("engine", "0"))
        return snaps.setdefault(key, {})

    for fam in families:
        if fam.name in _GAUGES or fam.name in _COUNTERS:
            target = _GAUGES.get(fam.name) or _COUNTERS[fam.name]
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                slot(s.labels)[target] = float(s.value)
        elif fam.name in _HISTOGRAMS:
            target = _HISTOGRAMS[fam.name]
            for s in fam.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                h = slot(labels).setdefault(target, {"sum": 0.0, "count": 0.0, "buckets": {}})
                if s.name.endswith("_bucket"):
                    h["buckets"][s.labels["le"]] = float(s.value)
                elif s.name.endswith("_sum"):
                    h["sum"] = float(s.value)
                elif s.name.endswith("_count"):
                    h["count"] = float(s.value)
        elif fam.name == "vllm:cache_config_info":
            # labelled by engine only (no model_name): applied to that engine's snapshots below
            for s in fam.samples:
                info = cache_info.setdefault(s.labels.get("engine"), {})
                for k in ("block_size", "num_gpu_blocks"):
                    v = s.labels.get(k)
                    if v not in (None, "", "None"):
                        info[k] = int(float(v))
    if not snaps:
        raise MetricsParseError("no vllm:* metrics in the exposition")
    # An engine is a (model_name, engine) with a gauge or a counter (else only histograms). vLLM
    # creates its counters per engine at start, at 0; its gauges are set from the engine's first
    # scheduler stats on, and until then they are 0 in one API server but missing in the
    # multiprocess mode of several (a "mostrecent" gauge never set is left out;
    # tests/fixtures/vllm/0.33.0/metrics-multiproc-start.prom): missing gauges read as 0.
    engines = [(key, d) for key, d in sorted(snaps.items()) if _ENGINE_SERIES & d.keys()]
    # vLLM's front end writes its one CacheConfig into a cache_config_info row per engine it manages,
    # and that config's num_gpu_blocks is the sum over those engines (0.33's
    # MPClient._apply_ready_response adds up each engine's ready response; the tests'
    # vllm/0.33.0/metrics-dp2.prom). Each engine gets an equal share (the remainder to the first
    # ones), so the blocks of a pod's engines add up to what vLLM reports, not to N times it.
    def cache_of(engine: str) -> dict[str, int]:
        return cache_info.get(engine) or cache_info.get(None) or {}

    with_blocks = list(dict.fromkeys(e for (_, e), _ in engines if "num_gpu_blocks" in cache_of(e)))
    shares = {e: cache_of(e)["num_gpu_blocks"] // len(with_blocks)
              + (1 if i < cache_of(e)["num_gpu_blocks"] % len(with_blocks) else 0) for i, e in enumerate(with_blocks)}
    out = []
    for (model_name, engine), d in engines:
        hist = {k: HistogramSnapshot(**v) for k, v in d.items() if isinstance(v, dict)}
        plain = {k: v for k, v in d.items() if not isinstance(v, dict)}
        plain.update(cache_of(engine))
        if engine in shares:
            plain["num_gpu_blocks"] = shares[engine]
        plain.setdefault("num_requests_running", 0.0)
        plain.setdefault("num_requests_waiting", 0.0)
        plain.setdefault("kv_cache_usage_perc", 0.0)
        plain["kv_cache_usage_perc"] = min(1.0, max(0.0, plain["kv_cache_usage_perc"]))
        out.append(EngineMetrics(pod=pod, model=model_name, engine=engine, role=role, ts=ts, **plain, **hist))
    if not out:
        raise MetricsParseError("no engine gauges or counters (vllm:num_requests_running, vllm:prompt_tokens) "
                                "in the exposition")
    return out


@dataclass(frozen=True)
class Target:
    url: str
    pod: str
    role: str = "aggregated"
    model: str | None = None


@dataclass
class TargetStatus:
    up: bool = False
    last_ok: float | None = None
    last_error: str | None = None
    consecutive_failures: int = 0
    snapshots: int = 0


class MetricsCollector:
    def __init__(self, targets: list[Target], js: JetStreamContext, *, subject_prefix: str | None = None,
                 registry: CollectorRegistry | None = None, timeout_s: float = 3.0,
                 client: httpx.AsyncClient | None = None):
        if not targets:
            raise ValueError("at least one metrics target is required")
        self.targets = targets
        self.js = js
        self.prefix = subject_prefix
        self.timeout_s = timeout_s
        self._client = client
        self.status: dict[str, TargetStatus] = {t.url: TargetStatus() for t in targets}
        self.errors = Counter("infernex_metrics_scrape_errors_total", "failed scrapes by target and reason",
                              ["pod", "reason"], registry=registry)
        self.up = Gauge("infernex_metrics_target_up", "1 if the last scrape of the target worked", ["pod"],
                        registry=registry)
        self.published = Counter("infernex_metrics_snapshots_total", "engine snapshots published", ["pod"],
                                 registry=registry)

    def _fail(self, t: Target, reason: str, detail: str) -> None:
        st = self.status[t.url]
        st.up = False
        st.last_error = f"{reason}: {detail}"
        st.consecutive_failures += 1
        self.errors.labels(t.pod, reason).inc()
        self.up.labels(t.pod).set(0)
        log.warning("metrics target %s (%s) %s: %s", t.url, t.pod, reason, detail)

    async def scrape(self, client: httpx.AsyncClient, t: Target) -> list[EngineMetrics]:
        ts = time.time()
        try:
            resp = await client.get(t.url, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            self._fail(t, "unreachable", f"{type(exc).__name__}: {exc}")
            return []
        if resp.status_code != 200:
            self._fail(t, "http_status", f"HTTP {resp.status_code}")
            return []
        try:
            snaps = parse_vllm_metrics(resp.text, t.pod, ts, role=t.role, model=t.model)
        except (MetricsParseError, ValueError) as exc:
            self._fail(t, "unparsable", str(exc))
            return []
        st = self.status[t.url]
        st.up, st.last_ok, st.last_error, st.consecutive_failures = True, ts, None, 0
        self.up.labels(t.pod).set(1)
        return snaps

    async def scrape_once(self) -> list[EngineMetrics]:
        client = self._client or httpx.AsyncClient()
        try:
            results = await asyncio.gather(*(self.scrape(client, t) for t in self.targets))
        finally:
            if self._client is None:
                await client.aclose()
        out = []
        for t, snaps in zip(self.targets, results):
            for snap in snaps:
                subject = S.with_prefix(self.prefix, S.engine_metrics(t.pod))
                await bus.publish(self.js, subject, snap.to_json(),
                                  msg_id=f"{t.pod}:{snap.engine}:{snap.ts:.6f}")
                self.published.labels(t.pod).inc()
                self.status[t.url].snapshots += 1
                out.append(snap)
        return out

    async def run(self, stop: asyncio.Event, interval_s: float = 5.0) -> None:
        await bus.run_periodically(self.scrape_once, stop, interval_s)
