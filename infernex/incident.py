"""Rebuild the cluster's state from JetStream history, re-decide past requests, and write
incident reports.

Composition only: the folds are the live ones (:class:`streams.kv_index.KvIndex`, the
router's :class:`router.state.ClusterState` with its load and pod-health folds,
:class:`streams.health.HealthState`), fed in store order with a clock that follows the
messages' store times. So the state replay reaches at an instant is the state the live
services held then (up to their own consumer lag), and ``decide`` runs the router's real
strategy code against it.

Speed: KV batches (most of the history) are decoded with the indexer's msgspec fast path and
queued; the queue is folded with one ``KvIndex.apply_many`` call (whose cost is mostly per
call) when it holds ``FLUSH_EVERY`` batches or when anything reads the index, each batch
with the clock value it arrived at, so every read sees exactly the one-by-one state.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from consumers.indexer import decode_batch, message_parts
from consumers.replay import ReplayMsg
from consumers.replay_scope import PodMeta, Scope
from router.config import RouterConfig
from router.core import Router
from router.state import ClusterState
from router.tokenize import PromptEncoder
from router.types import RoutingRequest
from schemas import (
    BlockRemoved,
    BlockStored,
    DeadLetter,
    DeviceTelemetry,
    Diagnosis,
    EngineAnnouncement,
    EngineMetrics,
    KvEventBatch,
    RequestRecord,
    RoutingDecision,
    ScalingHint,
    ValidationFailure,
    decode_event,
)
from schemas.registry import model_for_subject
from schemas.subjects import kv_events
from streams.clock import ManualClock
from streams.health import HealthState
from streams.kv_index import KvIndex
from streams.kv_keys import KEY_SCHEME


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


_U32 = (1 << 32) - 1
# queued KV batches folded in one index call at most. Measured on bench/replay.py's history: 1 per
# call 34.5k msgs/s, 8: 40.3k, 32: 42.3k, 128: 36.6k, 512: 23.0k (queued events stay alive, so
# allocating the next ones and the garbage collector's passes cost more)
FLUSH_EVERY = 32


@dataclass(frozen=True, order=True)
class TimelineEntry:
    ts: float
    kind: str  # diagnosis | resolution | engine-reset | cache-cleared | kv-gap | routing-anomaly | sla-breach | error | hint | dead-letter
    subject: str
    text: str
    # what the entry is about, for scoping (--pool/--role/--model): pods, and a device (node, device)
    pods: tuple[str, ...] = field(default=(), compare=False)
    device: tuple[str, str] | None = field(default=None, compare=False)


@dataclass
class SlaTargets:
    ttft_s: float = 2.0
    itl_s: float = 0.1
    e2e_s: float | None = None


@dataclass
class ReplayState:
    """All folds at the instant of the last applied message."""

    pool: str | None = None
    targets: SlaTargets = field(default_factory=SlaTargets)
    scope: Scope | None = None  # --pool/--role/--model; ``pool`` alone is Scope(pool=pool)

    def __post_init__(self) -> None:
        if self.scope is None:
            self.scope = Scope(pool=self.pool)
        elif self.pool is None:
            self.pool = self.scope.pool
        self.clock = ManualClock(0.0)
        self._index = KvIndex(self.clock)
        # KV batches waiting to be folded, and each one's clock value (``last_seen``): the index
        # costs a fixed few us per apply call, so consecutive batches are folded in one call, when
        # something reads the index (``index``, ``state``, ``decide``, ``kv_part``) or the queue is full
        self._pending: list[KvEventBatch] = []
        self._pending_seen: list[float] = []
        self.cluster = ClusterState(RouterConfig(pool=self.pool or "default", bus=False), clock=self.clock)
        self.health = HealthState(self.clock)
        self.timeline: list[TimelineEntry] = []
        self.counts: Counter[str] = Counter()  # every message read, by kind (whatever the scope)
        self.scoped_counts: Counter[str] = Counter()  # records, decisions, hints, dead letters in scope
        self.pod_counts: dict[str, Counter[str]] = {}  # pod -> messages about it (KV, metrics, announcements)
        self.device_counts: dict[tuple[str, str], Counter[str]] = {}  # (node, device) -> telemetry, diagnoses
        self.pod_meta: dict[str, PodMeta] = {}  # from announcements: what scopes a pod
        self.undecodable: list[tuple[str, str]] = []
        self.records: list[RequestRecord] = []
        self.decisions: dict[str, list[RoutingDecision]] = {}  # request id -> its records, in order
        self._kv_pos: dict[str, tuple[int, int]] = {}
        self._models: dict[str, type] = {}
        self.first_ts: float | None = None
        self.last_ts: float | None = None

    # ---------------------------------------------------------------------------- folding
    @property
    def index(self) -> KvIndex:
        """The KV index fold, with every KV batch applied so far folded in."""
        if self._pending:
            self.flush()
        return self._index

    def flush(self) -> None:
        """Fold the queued KV batches into the index (one call; each batch's pod gets the
        ``last_seen`` it would have had with the batches applied one by one)."""
        batches, seen = self._pending, self._pending_seen
        if not batches:
            return
        self._pending, self._pending_seen = [], []
        self._index.apply_many(batches, seen=seen)

    def apply_many(self, msgs: Iterable[ReplayMsg]) -> None:
        """Fold a run of messages in store order (what :func:`read_window_batches` yields).

        Same as :meth:`apply` one by one; KV batches (most of the history) take a shorter path."""
        ap, advance = self.apply, self._advance
        models = self._models
        for m in msgs:
            if models.get(m.subject) is not KvEventBatch:
                ap(m)
                continue
            advance(m.ts)
            self._kv_message(m)

    def _model(self, subject: str) -> type:
        model = self._models.get(subject)
        if model is None:
            model = self._models[subject] = model_for_subject(subject)  # ValueError if not ours
        return model

    def _pod_count(self, pod: str, kind: str) -> None:
        c = self.pod_counts.get(pod)
        if c is None:
            c = self.pod_counts[pod] = Counter()
        c[kind] += 1

    def _device_count(self, node: str, device: str, kind: str) -> None:
        c = self.device_counts.get((node, device))
        if c is None:
            c = self.device_counts[(node, device)] = Counter()
        c[kind] += 1

    # ------------------------------------------------------------------------- scoping
    def pod_in_scope(self, pod: str) -> bool:
        return self.scope.keep_pod(self.pod_meta.get(pod))

    def device_in_scope(self, node: str, device: str, pods=()) -> bool:
        return self.scope.keep_device(node, device, pods, self.pod_meta)

    def visible_counts(self) -> Counter[str]:
        """Messages by kind within the scope (pods and devices judged by their announcements)."""
        out = Counter(self.scoped_counts)
        for k in ("undecodable", "rejected"):
            if self.counts.get(k):
                out[k] = self.counts[k]
        for pod, c in self.pod_counts.items():
            if self.pod_in_scope(pod):
                out.update(c)
        for (node, dev), c in self.device_counts.items():
            if self.device_in_scope(node, dev):
                out.update(c)
        return out

    def visible_timeline(self) -> list[TimelineEntry]:
        """The timeline within the scope, in order."""
        if not self.scope.narrowed:
            return sorted(self.timeline)
        out = []
        for e in self.timeline:
            if e.device is not None:
                if self.device_in_scope(e.device[0], e.device[1], e.pods):
                    out.append(e)
            elif e.pods:
                if any(self.pod_in_scope(p) for p in e.pods):
                    out.append(e)
            else:
                out.append(e)  # already scoped when recorded (requests, hints), or not attributable
        return sorted(out)

    def _kv_message(self, msg: ReplayMsg) -> None:
        """A ``kv.events`` message: one batch, or a bridge's group, each batch decoded (or counted
        undecodable) on its own."""
        try:
            parts = message_parts(msg.data)
        except (ValueError, ValidationFailure) as exc:
            self._undecodable(msg, exc)
            return
        for part in parts:
            try:
                batch = decode_batch(part)
            except (ValueError, ValidationFailure) as exc:
                self._undecodable(msg, exc)
                continue
            self._kv(msg, batch)

    def _undecodable(self, msg: ReplayMsg, exc: Exception) -> None:
        self.counts["undecodable"] += 1
        self.undecodable.append((msg.subject, str(exc)[:200]))

    def _advance(self, ts: float) -> None:
        """The replay clock follows the messages' store times (never backwards)."""
        clock = self.clock
        if ts > clock.now():
            clock.set(ts)
        if self.first_ts is None:
            self.first_ts = ts
        self.last_ts = ts

    def apply(self, msg: ReplayMsg) -> None:
        self._advance(msg.ts)
        try:
            model = self._model(msg.subject)
            # KV batches are most of the history: the indexer's msgspec fast path (pydantic
            # only for payloads it does not accept exactly, which it then validates or names)
            if model is KvEventBatch:
                self._kv_message(msg)
                return
            event = decode_event(model, msg.data)
        except (ValueError, ValidationFailure) as exc:
            self._undecodable(msg, exc)
            return
        name = model.__name__
        self.counts[name] += 1
        scope = self.scope
        if isinstance(event, EngineMetrics):
            self._pod_count(event.pod, name)
            self.cluster.apply_metrics(event)
            self.health.apply_load(event)
        elif isinstance(event, DeviceTelemetry):
            self._device_count(event.node, event.device, name)
            self.health.apply(event)
            self.cluster.apply_device(event)  # utilisation and memory: the health score's cpu/mem terms
        elif isinstance(event, Diagnosis):
            self._device_count(event.node, event.device, name)
            self.cluster.apply_diagnosis(event)
            self.health.apply_diagnosis(event)
            kind = "resolution" if event.status == "resolved" else "diagnosis"
            if event.status != "updated":
                pods = f" (pods {', '.join(event.pods)})" if event.pods else ""
                self.timeline.append(TimelineEntry(msg.ts, kind, msg.subject,
                                                   f"{event.severity} {event.fault_mode} on {event.node}/{event.device}"
                                                   f"{pods}: {event.summary}; action {event.action}",
                                                   tuple(event.pods), (event.node, event.device)))
        elif isinstance(event, EngineAnnouncement):
            self._pod_count(event.pod, name)
            self.pod_meta[event.pod] = PodMeta(event.pool, event.model, event.role, event.node, tuple(event.devices))
            self.cluster.apply_announcement(event)
        elif isinstance(event, RequestRecord):
            if scope.keep_record(event):
                self.scoped_counts[name] += 1
                self._record(msg, event)
        elif isinstance(event, RoutingDecision):
            if scope.keep_decision(event):
                self.scoped_counts[name] += 1
                self.decisions.setdefault(event.request_id, []).append(event)
        elif isinstance(event, ScalingHint):
            if scope.keep_hint(event):
                self.scoped_counts[name] += 1
                if event.desired != event.current:
                    self.timeline.append(TimelineEntry(msg.ts, "hint", msg.subject,
                                                       f"{event.pool}/{event.role}: {event.current} -> "
                                                       f"{event.desired} replicas ({event.reason})"))
        elif isinstance(event, DeadLetter):
            self.scoped_counts[name] += 1  # not attributable to a pool: always shown
            self.timeline.append(TimelineEntry(msg.ts, "dead-letter", msg.subject,
                                               f"{event.stream}: {event.reason[:160]}"))

    # ------------------------------------------------------------- parallel KV replay
    def kv_part(self) -> dict[str, Any]:
        """This state's KV side, to be merged into another state (:meth:`merge_kv_parts`):
        a replay that folded only some pods' KV subjects hands this back (picklable)."""
        return {
            "dump": [b.to_json() for b in self.index.dump()],
            "last_seen": {name: p.last_seen for name, p in self.index.pods().items()},
            "timeline": list(self.timeline),
            "counts": dict(self.counts),
            "scoped_counts": dict(self.scoped_counts),
            "pod_counts": {p: dict(c) for p, c in self.pod_counts.items()},
            "undecodable": list(self.undecodable),
            "kv_pos": dict(self._kv_pos),
            "first_ts": self.first_ts,
            "last_ts": self.last_ts,
        }

    def merge_kv_parts(self, parts: Iterable[dict[str, Any]]) -> None:
        """Merge states that folded disjoint sets of pods' KV events (and nothing else) into
        this one. A pod's KV fold depends only on its own batches, so restoring each part's
        dump (the index written back out as events) gives the state one sequential fold
        reaches; each pod's batch is restored at the clock value it was last applied at."""
        parts = list(parts)
        restore = []
        for part in parts:
            seen = part["last_seen"]
            for data in part["dump"]:
                b = decode_batch(data)
                restore.append((seen.get(b.pod) or 0.0, b.pod, b))
            self.timeline.extend(part["timeline"])
            self.counts.update(part["counts"])
            self.scoped_counts.update(part.get("scoped_counts", {}))
            for p, c in part.get("pod_counts", {}).items():
                self.pod_counts.setdefault(p, Counter()).update(c)
            self.undecodable.extend(part["undecodable"])
            self._kv_pos.update(part["kv_pos"])
            for ts in (part["first_ts"], part["last_ts"]):
                if ts is not None:
                    self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
                    self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)
        self.flush()
        restore.sort(key=lambda r: (r[0], r[1]))
        self._index.apply_many([b for _, _, b in restore], seen=[seen for seen, _, _ in restore])
        now = self.clock.now()
        self.clock.set(max([now] + [p["last_ts"] for p in parts if p["last_ts"] is not None]))
        self.timeline.sort()

    def _kv(self, msg: ReplayMsg, batch: KvEventBatch) -> None:
        pod = batch.pod
        c = self.pod_counts.get(pod)
        if c is None:
            c = self.pod_counts[pod] = Counter()
        c["KvEventBatch"] += 1
        self.counts["KvEventBatch"] += 1
        pods = (pod,)
        prev = self._kv_pos.get(pod)
        if prev is not None and batch.epoch == prev[0] and batch.seq > prev[1] + 1:
            self.timeline.append(TimelineEntry(msg.ts, "kv-gap", msg.subject,
                                               f"{pod}: KV events {prev[1] + 1}..{batch.seq - 1} missing", pods))
        careful = False
        for ev in batch.events:
            t = ev.type
            if t == "stored":
                toks = ev.token_ids
                # the pydantic path admits token ids the fold cannot key (>= 2**32): such a batch
                # is applied on its own, so its rejection cannot take queued batches with it
                if type(toks) is list and toks and max(toks) > _U32:
                    careful = True
            elif t == "removed":
                pass
            elif t == "reset":
                self.timeline.append(TimelineEntry(msg.ts, "engine-reset", msg.subject,
                                                   f"{pod}: {ev.reason} (epoch {batch.epoch})", pods))
            elif t == "cleared":
                self.timeline.append(TimelineEntry(msg.ts, "cache-cleared", msg.subject,
                                                   f"{pod}: all KV blocks cleared", pods))
            elif t == "gone":
                self.timeline.append(TimelineEntry(msg.ts, "engine-reset", msg.subject, f"{pod}: {ev.reason}", pods))
        self._kv_pos[pod] = (batch.epoch, batch.seq)
        if careful:
            self.flush()
            try:
                self._index.apply_many((batch,), seen=(self.clock.now(),))
            except ValueError as exc:
                self.counts["rejected"] += 1
                self.undecodable.append((msg.subject, f"KV batch rejected by the index: {exc}"[:200]))
            return
        self._pending.append(batch)
        self._pending_seen.append(self.clock.now())
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def _record(self, msg: ReplayMsg, r: RequestRecord) -> None:
        self.records.append(r)
        if r.best_overlap_blocks > r.chosen_overlap_blocks:
            self.timeline.append(TimelineEntry(
                msg.ts, "routing-anomaly", msg.subject,
                f"request {r.request_id} went to {', '.join(r.pods) or '?'} with {r.chosen_overlap_blocks} cached "
                f"blocks while another backend had {r.best_overlap_blocks}"))
        if r.status != "ok":
            self.timeline.append(TimelineEntry(msg.ts, "error", msg.subject,
                                               f"request {r.request_id} {r.status} ({r.http_status}): {r.error or ''}"[:200]))
            return
        breaches = []
        if r.ttft_s is not None and r.ttft_s > self.targets.ttft_s:
            breaches.append(f"TTFT {r.ttft_s:.3f}s > {self.targets.ttft_s}s")
        if r.itl_s is not None and r.itl_s > self.targets.itl_s:
            breaches.append(f"ITL {r.itl_s * 1000:.0f}ms > {self.targets.itl_s * 1000:.0f}ms")
        if self.targets.e2e_s is not None and r.e2e_s is not None and r.e2e_s > self.targets.e2e_s:
            breaches.append(f"e2e {r.e2e_s:.2f}s > {self.targets.e2e_s}s")
        if breaches:
            self.timeline.append(TimelineEntry(msg.ts, "sla-breach", msg.subject,
                                               f"request {r.request_id} on {', '.join(r.pods)}: {'; '.join(breaches)}"))

    # ---------------------------------------------------------------------------- queries
    def state(self) -> dict[str, Any]:
        pods = {}
        for name, info in sorted(self.index.pods().items()):
            if not self.pod_in_scope(name):
                continue
            pods[name] = {"kv": {k: v for k, v in vars(info).items() if not k.startswith("_")}}
        for b in self.cluster.snapshot():
            if not self.pod_in_scope(b.pod):
                continue
            p = pods.setdefault(b.pod, {})
            p.update({"role": b.role, "group": b.group, "url": b.url, "waiting": b.waiting, "running": b.running,
                      "kv_usage": b.kv_usage, "health": b.health})
        open_findings = [
            {"node": d.node, "device": d.device, "fault_mode": d.fault_mode, "severity": d.severity,
             "action": d.action, "since": iso(d.first_seen), "pods": d.pods}
            for d in self.cluster.health.open_findings() if self.device_in_scope(d.node, d.device, d.pods)
        ]
        return {
            "at": iso(self.last_ts) if self.last_ts else None,
            "messages": dict(sorted(self.visible_counts().items())),
            "pods": pods,
            "open_findings": sorted(open_findings, key=lambda f: (f["node"], f["device"], f["fault_mode"])),
        }

    def decide(self, body: dict[str, Any], profile: str, *, tokenizer: str | None = "simple") -> dict[str, Any]:
        """Re-run the router's strategy on ``body`` (an OpenAI request) against this state."""
        kind = "chat" if "messages" in body else "completions"
        encoder = PromptEncoder(tokenizer)
        token_ids = encoder.encode(kind, body)
        model = body.get("model")
        if not model:
            raise ValueError("the request needs a model")
        router = Router(profile, seed=0)
        req = RoutingRequest(model=model, request_id=body.get("request_id", "replayed"), token_ids=token_ids,
                             prompt_tokens=0 if token_ids is None else len(token_ids), max_tokens=body.get("max_tokens"))
        decision = router.decide(req, self.cluster.snapshot(), self.index, self.clock.now())
        out = decision.to_dict()
        out["at"] = iso(self.clock.now()) if self.last_ts else None
        return out


def explain_request(history: ReplayState, stages: list[RoutingDecision], *,
                    other: str | None = None) -> dict[str, Any]:
    """:func:`consumers.redecide.explain` for one recorded attempt, with what the history rebuilt
    up to the decision's instant says: each backend's bus-fed inputs (load, device utilisation,
    health), the prompt's prefix in the KV index per pod, and the findings in force on them."""
    from consumers.redecide import explain

    inputs = stages[0].inputs
    pods = [b.pod for b in inputs.backends] if inputs is not None else []
    hist = {}
    for b in history.cluster.snapshot():
        hist[b.pod] = {"waiting": b.waiting, "running": b.running, "kv_usage": b.kv_usage,
                       "num_gpu_blocks": b.num_gpu_blocks, "cpu_util": b.cpu_util, "mem_util": b.mem_util,
                       "health": b.health}
    findings = []
    for pod in pods:
        for d in history.cluster.health.findings_for(pod):
            findings.append({"pod": pod, "node": d.node, "device": d.device, "fault_mode": d.fault_mode,
                             "severity": d.severity, "action": d.action, "since": iso(d.first_seen),
                             "summary": d.summary})
    index_blocks = None
    left_out = None
    if inputs is not None and inputs.prefix_keys:
        if inputs.key_scheme == KEY_SCHEME:
            model = inputs.index_model or stages[0].model
            got = history.index.match_keys(model, inputs.prefix_keys, pods)
            index_blocks = {p: int(m.matched_blocks) - int(m.predicted_blocks) for p, m in got.items()}
        else:  # keys of another function name other blocks: every pod would read 0
            left_out = (f"the router recorded the prompt's block keys under key scheme {inputs.key_scheme or 1}, "
                        f"the rebuilt index uses {KEY_SCHEME}: not compared")
    out = explain(stages, other=other, history=hist, findings=findings, index_blocks=index_blocks)
    if left_out:
        out["prefix"]["index_left_out"] = left_out
    out["at_iso"] = iso(stages[0].ts)
    return out


def warm_up() -> None:
    """Load the KV index's compiled kernels (the decoder's and the fold's) in this process:
    the first fold of a process otherwise pays for it (about half a CPU second)."""
    st = ReplayState()
    batch = KvEventBatch(pod="warm-up", model="warm-up", seq=0, ts=0.0, events=[
        BlockStored(block_hashes=[1, 2], token_ids=list(range(8)), block_size=4),
        BlockRemoved(block_hashes=[2])])
    st.apply_many([ReplayMsg(0.0, "", 1, kv_events("warm-up", "warm-up"), batch.to_json())])
    st.kv_part()


# ------------------------------------------------------------------------------ the report
def report_markdown(st: ReplayState, start: float | None, end: float | None) -> str:
    lines = ["# InferNex incident report", ""]
    lines.append(f"Window: {iso(start) if start else 'beginning'} .. {iso(end) if end else 'end'}  ")
    sc = st.scope
    if sc.narrowed:
        lines.append("Scope: " + ", ".join(f"{k} {v}" for k, v in (("pool", sc.pool), ("role", sc.role),
                                                                     ("model", sc.model)) if v) + "  ")
    counts = st.visible_counts()
    timeline = st.visible_timeline()
    if st.first_ts is not None:
        lines.append(f"Messages: {sum(counts.values())} from {iso(st.first_ts)} to {iso(st.last_ts)}")
    lines += ["", "## Counts", "", "| kind | messages |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(counts.items())]
    kinds = Counter(e.kind for e in timeline)
    lines += ["", "## Summary", ""]
    for k in ("diagnosis", "resolution", "engine-reset", "cache-cleared", "kv-gap", "routing-anomaly", "sla-breach",
              "error", "hint", "dead-letter"):
        lines.append(f"- {k}: {kinds.get(k, 0)}")
    firsts = {}
    for e in timeline:
        firsts.setdefault(e.kind, e)
    if firsts:
        first = min(firsts.values())
        lines += ["", f"First notable event: **{first.kind}** at {iso(first.ts)}: {first.text}"]
    if st.records:
        ok = [r for r in st.records if r.status == "ok"]
        ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        if ttft:
            p = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
            lines.append(f"\nRequests: {len(st.records)} ({len(st.records) - len(ok)} failed); TTFT p50 "
                         f"{p(0.5):.3f}s p90 {p(0.9):.3f}s p99 {p(0.99):.3f}s")
        by_pod = Counter(p for r in st.records for p in r.pods[:1])
        lines.append("Requests by first pod: " + ", ".join(f"{k} {v}" for k, v in sorted(by_pod.items())))
    lines += ["", "## Timeline", "", "| time | kind | what |", "|---|---|---|"]
    for e in timeline:
        lines.append(f"| {iso(e.ts)} | {e.kind} | {e.text.replace('|', '/')} |")
    explain = _worth_explaining(st)
    if explain:
        lines += ["", "## Routing decisions to look at", "",
                  "Each line: why, and the command that shows every candidate's scores, the best alternative, "
                  "the prompt's cached prefix per pod, the findings in force and what another profile would "
                  "have done.", ""]
        lines += [f"- {why}: `infernex replay explain {rid}`" for rid, why in explain]
    st_now = st.state()
    lines += ["", "## State at the end of the window", "", "```json", json.dumps(st_now, indent=1, sort_keys=True),
              "```", ""]
    return "\n".join(lines)


def _worth_explaining(st: ReplayState, limit: int = 10) -> list[tuple[str, str]]:
    """Requests whose decision deserves a look (routed away from a better-cached pod, failed, or
    over the SLA), at most ``limit``, with their recorded decision."""
    out: list[tuple[str, str]] = []
    for r in st.records:
        if r.request_id not in st.decisions:
            continue
        why = None
        if r.best_overlap_blocks > r.chosen_overlap_blocks:
            why = (f"{r.request_id} went to {', '.join(r.pods) or '?'} with {r.chosen_overlap_blocks} cached blocks, "
                   f"another pod had {r.best_overlap_blocks}")
        elif r.status != "ok":
            why = f"{r.request_id} {r.status} ({r.http_status})"
        elif r.ttft_s is not None and r.ttft_s > st.targets.ttft_s:
            why = f"{r.request_id} TTFT {r.ttft_s:.3f}s on {', '.join(r.pods)}"
        if why:
            out.append((r.request_id, why))
            if len(out) >= limit:
                break
    return out


def report_html(markdown: str) -> str:
    """A self-contained page: the Markdown rendered minimally (headings, tables, lists, code)."""
    out = ['<!doctype html><html><head><meta charset="utf-8"><title>InferNex incident report</title>',
           "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:3px 6px}pre{background:#f6f6f6;padding:1em}</style></head><body>"]
    in_table = in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            out.append("</pre>" if in_code else "<pre>")
            in_code = not in_code
            continue
        if in_code:
            out.append(html.escape(line))
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(set(c) <= {"-"} for c in cells):
                continue
            if not in_table:
                out.append("<table>")
                in_table = True
                out.append("<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cells) + "</tr>")
            else:
                out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
            continue
        if in_table:
            out.append("</table>")
            in_table = False
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{html.escape(line[level:].strip())}</h{level}>")
        elif line.startswith("- "):
            out.append(f"<li>{html.escape(line[2:])}</li>")
        elif line.strip():
            out.append(f"<p>{html.escape(line.strip()).replace('**', '')}</p>")
    if in_table:
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
