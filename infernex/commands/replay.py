"""``infernex replay``: rebuild past state from JetStream, re-decide, report, republish."""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from infernex.commands.common import run_async
from rich.console import Console

console = Console()
err = Console(stderr=True)

ALL_SUBJECTS = ["kv.events.>", "engine.>", "device.telemetry.>", "diagnosis.>", "router.>", "autoscale.hints.>",
                "dlq.>"]

replay_app = typer.Typer(help="Replay JetStream history: state at an instant, re-decide, incident report, republish.",
                         no_args_is_help=True)


@dataclass
class Window:
    start: float | None
    end: float | None
    start_seq: int | None
    subjects: list[str]
    workers: int = 1  # processes folding the KV events; 0 = automatic


def _time(value: str | None) -> float | None:
    if value is None:
        return None
    from infernex.commands.common import parse_since

    try:
        return float(value)  # epoch seconds
    except ValueError:
        return parse_since(value).timestamp()


@replay_app.callback()
def _window(
    ctx: typer.Context,
    start: Optional[str] = typer.Option(None, "--from", help="start: ISO time, epoch seconds, or '10m' ago"),
    end: Optional[str] = typer.Option(None, "--to", help="end (inclusive): ISO time, epoch seconds, or '5m' ago"),
    from_seq: Optional[int] = typer.Option(None, "--from-seq", help="start at this stream sequence"),
    subjects: list[str] = typer.Option(ALL_SUBJECTS, "--subjects", "-s", help="subject filters (repeat)"),
    workers: int = typer.Option(0, "--workers", min=0,
                                help="processes folding KV events in parallel (pods split among them); 0 = "
                                     "automatic (the free cores, up to 4, from 50k stored KV messages on), "
                                     "1 = this process only"),
) -> None:
    ctx.ensure_object(dict)
    ctx.meta["window"] = Window(_time(start), _time(end), from_seq, list(subjects), workers)


AUTO_WORKERS_MIN_KV = 50_000  # below this many stored KV messages, one process is as fast


async def fold_window(settings, window: Window, state, stats: dict | None = None) -> int:
    """Fold the window's messages into ``state``; returns how many were applied.

    ``window.workers`` > 1 (or 0 = automatic: the free cores, at most 4, when the KV stream
    holds at least ``AUTO_WORKERS_MIN_KV`` messages) folds the KV-event subjects in that
    many processes, each reading and folding a share of the pods, while this process folds
    the other streams; the parts are then merged (:meth:`ReplayState.merge_kv_parts`).
    Workers are forked where the platform allows (see :func:`_worker_context`).

    ``stats``, if given, gets ``processes``, the CPU seconds each used (``cpu_s``: this
    process first, then the workers), to tell what parallel folding buys on a machine, and
    with workers ``start_method`` (``fork`` or ``spawn``)."""
    from consumers import bus
    from consumers.replay import partition_subjects, read_window_batches, streams_for
    from schemas import subjects as S
    from streams.topology import build_topology, stream_for_subject

    prefix = settings.nats.subject_prefix
    scope = getattr(state, "scope", None)
    if scope is not None and scope.narrowed:  # read only the pool's / model's subjects where they say so
        window = Window(window.start, window.end, window.start_seq, scope.subjects(window.subjects), window.workers)
    workers = window.workers
    cpu0 = time.process_time()
    nc = await bus.connect(settings.nats, name="infernex-replay")
    n = 0
    try:
        topo = build_topology(settings.topology, prefix)
        groups: list[list[str]] = []
        skip: frozenset[str] = frozenset()
        if workers != 1:
            kv_stream = stream_for_subject(topo, S.with_prefix(prefix, S.kv_events("m", "p"))).name
            kv_filters = streams_for(topo, [S.with_prefix(prefix, s) for s in window.subjects]).get(kv_stream, [])
            if kv_filters:
                strip = len(prefix) + 1 if prefix else 0
                want = workers or _auto_workers()
                groups, total = await partition_subjects(nc, topo, [f[strip:] for f in kv_filters], want,
                                                         prefix=prefix)
                if workers == 0 and total < AUTO_WORKERS_MIN_KV:
                    groups = []
                if len(groups) > 1:
                    skip = frozenset({kv_stream})
                else:
                    groups = []
        pool = None
        futures = []
        if groups:
            ctx = _worker_context()
            if stats is not None:
                stats["start_method"] = ctx.get_start_method()
            pool = ProcessPoolExecutor(max_workers=len(groups), mp_context=ctx)
            loop = asyncio.get_running_loop()
            futures = [loop.run_in_executor(pool, _kv_worker, settings.nats, settings.topology, g, window)
                       for g in groups]
        try:
            async for run in read_window_batches(nc, topo, window.subjects, start_time=window.start,
                                                 end_time=window.end, start_seq=window.start_seq,
                                                 prefix=prefix, skip_streams=skip):
                state.apply_many(run)
                n += len(run)
            parts = await asyncio.gather(*futures)
            if parts:
                state.merge_kv_parts(p for p, _, _ in parts)
                n += sum(k for _, k, _ in parts)
            if stats is not None:
                stats["processes"] = 1 + len(parts)
                stats["cpu_s"] = [time.process_time() - cpu0] + [c for _, _, c in parts]
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
    finally:
        await nc.close()
    return n


def _worker_context():
    """Fork where the platform has it: a forked worker starts with this process's modules and
    compiled KV kernels (warmed here first), where a spawned one would spend about 1.5 CPU
    seconds importing and loading them. Forking is safe here: it happens from the event loop's
    thread before the pool's own threads start, only when this process runs no other thread, and a
    worker builds its own event loop and NATS connection (asyncio ignores a loop inherited
    through fork)."""
    if "fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1:
        return multiprocessing.get_context("spawn")
    from infernex.incident import warm_up

    warm_up()
    return multiprocessing.get_context("fork")


def _auto_workers() -> int:
    """Cores that are free now (CPUs we may run on minus the 1-minute load), at most 4."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, int(cpus - os.getloadavg()[0] + 0.5)))


def _kv_worker(nats_config, topology_config, subjects: list[str], window: Window) -> tuple[dict, int, float]:
    """In a worker process: fold these KV subjects over the window; the part, its size and
    the CPU seconds it took."""
    from types import SimpleNamespace

    from infernex.incident import ReplayState

    cpu0 = time.process_time()
    # a forked worker holds its parent's objects: out of the collector's way, so its passes
    # neither walk them nor touch (copy) their pages
    gc.freeze()
    state = ReplayState()
    sub = Window(window.start, window.end, window.start_seq, subjects, workers=1)
    n = asyncio.run(fold_window(SimpleNamespace(nats=nats_config, topology=topology_config), sub, state))
    part = state.kv_part()
    return part, n, time.process_time() - cpu0


def _settings(ctx):
    from infernex.cli import settings_of

    return settings_of(ctx)


def _run(coro):
    return run_async(coro, value_errors=True)


POOL = typer.Option(None, "--pool", help="only this pool (requests, decisions, hints, its pods and devices)")
ROLE = typer.Option(None, "--role", help="only this role: aggregated, prefill, decode, or pd (both)")
MODEL = typer.Option(None, "--model", help="only this model (requests, decisions, its pods and KV events)")


def _scope(pool: str | None, role: str | None, model: str | None):
    from consumers.replay_scope import Scope

    try:
        return Scope(pool=pool, role=role, model=model)
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@replay_app.command("state")
def state_cmd(ctx: typer.Context, pool: Optional[str] = POOL, role: Optional[str] = ROLE,
              model: Optional[str] = MODEL) -> None:
    """Print the folded state (KV index per pod, load, health, open findings) at the window's end."""
    from infernex.incident import ReplayState

    st = ReplayState(scope=_scope(pool, role, model))
    n = _run(fold_window(_settings(ctx), ctx.meta["window"], st))
    out = st.state()
    out["replayed_messages"] = n
    print(json.dumps(out, indent=2, sort_keys=True))


def _find_decision(ctx, request_id: str, scope, attempt: int):
    """The recorded attempt (its stage records) of ``request_id`` in the window."""
    from consumers.redecide import attempts
    from infernex.incident import ReplayState

    window = ctx.meta["window"]
    st = ReplayState(scope=scope)
    search = Window(window.start, window.end, window.start_seq, ["router.decisions.>"], 1)
    _run(fold_window(_settings(ctx), search, st))
    recs = st.decisions.get(request_id)
    if not recs:
        err.print(f"[red]no routing decision for request {request_id!r} in the window; widen --from/--to "
                  f"(before the command) or drop --pool/--role/--model[/red]")
        raise typer.Exit(1)
    tries = attempts(recs)
    if not -len(tries) <= attempt < len(tries):
        err.print(f"[red]request {request_id!r} has {len(tries)} attempt(s); --attempt is 0..{len(tries) - 1} "
                  f"or -1 for the last[/red]")
        raise typer.Exit(2)
    return tries[attempt]


@replay_app.command("decide")
def decide_cmd(
    ctx: typer.Context,
    request: str = typer.Argument(..., help="a request id recorded by the router, or an OpenAI request body "
                                            "(JSON file) to route against the state at the window's end"),
    profile: Optional[str] = typer.Option(None, "--profile", help="strategy to run (default: the recorded one "
                                                                  "for a request id, kv-aware for a body)"),
    tokenizer: str = typer.Option("simple", "--tokenizer", help="'simple' or a tokenizer.json path"),
    attempt: int = typer.Option(-1, "--attempt", help="which decision of a retried request (0 = first)"),
    pool: Optional[str] = POOL, role: Optional[str] = ROLE, model: Optional[str] = MODEL,
) -> None:
    """Re-run a recorded decision from what it read (scores come out equal), or route a request body
    against the state at the window's end."""
    from infernex.incident import ReplayState

    scope = _scope(pool, role, model)
    path = Path(request)
    if not path.is_file() and not request.endswith(".json"):
        from consumers.redecide import NotReplayable, compare, redecide

        stages = _find_decision(ctx, request, scope, attempt)
        try:
            dec, forced = redecide(stages, strategy=profile)
        except (NotReplayable, ValueError) as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from None
        out = dec.to_dict()
        out["request_id"] = request
        out["at"] = stages[0].ts
        if profile is None:
            diffs = compare(stages, dec)
            out["reproduced"] = not diffs
            out["differences"] = diffs
            out["random_draw_used"] = forced
        print(json.dumps(out, indent=2))
        return
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        err.print(f"[red]cannot read {request}: {exc}[/red]")
        raise typer.Exit(2) from None
    profile = profile or "kv-aware"
    st = ReplayState(scope=scope)
    _run(fold_window(_settings(ctx), ctx.meta["window"], st))
    try:
        print(json.dumps(st.decide(body, profile, tokenizer=tokenizer), indent=2))
    except (ValueError, FileNotFoundError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@replay_app.command("report")
def report_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(Path("infernex-incident"), "--out", help="directory for report.md and report.html"),
    ttft_target: float = typer.Option(2.0, "--ttft-target", help="SLA target for TTFT (s)"),
    itl_target: float = typer.Option(0.1, "--itl-target", help="SLA target for inter-token latency (s)"),
    pool: Optional[str] = POOL, role: Optional[str] = ROLE, model: Optional[str] = MODEL,
) -> None:
    """Write an incident report (Markdown and self-contained HTML) for the window."""
    from infernex.incident import ReplayState, SlaTargets, report_html, report_markdown

    window = ctx.meta["window"]
    st = ReplayState(scope=_scope(pool, role, model), targets=SlaTargets(ttft_s=ttft_target, itl_s=itl_target))
    n = _run(fold_window(_settings(ctx), window, st))
    md = report_markdown(st, window.start, window.end)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(report_html(md))
    console.print(f"{n} messages replayed; {len(st.visible_timeline())} timeline entries; report in {out}/report.md "
                  "and .html")


@replay_app.command("explain")
def explain_cmd(
    ctx: typer.Context,
    request_id: str = typer.Argument(..., help="the request id (X-Request-Id) of a routed request"),
    profile: Optional[str] = typer.Option(None, "--profile", help="also show what this strategy would have picked"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    attempt: int = typer.Option(-1, "--attempt", help="which decision of a retried request (0 = first)"),
    pool: Optional[str] = POOL, role: Optional[str] = ROLE, model: Optional[str] = MODEL,
) -> None:
    """Why a past request went where it went: every candidate's score per scorer, the best
    alternative, the prompt's cached prefix per pod, the findings in force, another profile's pick."""
    from consumers.redecide import NotReplayable
    from consumers.replay_scope import Scope
    from infernex.incident import ReplayState, explain_request

    stages = _find_decision(ctx, request_id, _scope(pool, role, model), attempt)
    window = ctx.meta["window"]
    hist = ReplayState(scope=Scope(pool=stages[0].pool))
    upto = Window(window.start, stages[0].ts, window.start_seq,
                  ["kv.events.>", "engine.>", "device.telemetry.>", "diagnosis.>"], window.workers)
    _run(fold_window(_settings(ctx), upto, hist))
    try:
        out = explain_request(hist, stages, other=profile)
    except (NotReplayable, ValueError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(out, indent=2))
        return
    from infernex.commands.explain_view import render

    render(console, out)


@replay_app.command("republish")
def republish_cmd(
    ctx: typer.Context,
    prefix: str = typer.Argument(..., help="subject prefix to publish under, e.g. sandbox"),
    speed: float = typer.Option(1.0, "--speed", help="K x real time; 0 = as fast as possible"),
    pool: Optional[str] = POOL, role: Optional[str] = ROLE, model: Optional[str] = MODEL,
) -> None:
    """Re-publish the window under another subject prefix (to feed a sandboxed copy of the services)."""
    from consumers import bus
    from consumers.replay import read_window
    from consumers.replay_scope import PodMeta, keep_message
    from schemas import EngineAnnouncement, ValidationFailure, decode_event
    from schemas import subjects as S
    from streams.topology import build_topology

    settings = _settings(ctx)
    window = ctx.meta["window"]
    scope = _scope(pool, role, model)
    subjects = scope.subjects(window.subjects)

    async def go() -> int:
        nc = await bus.connect(settings.nats, name="infernex-republish")
        js = nc.jetstream()
        n = 0
        try:
            src_prefix = settings.nats.subject_prefix
            dst_prefix = S.with_prefix(src_prefix, prefix) if src_prefix else prefix
            await bus.apply_topology(js, build_topology(settings.topology, dst_prefix))
            t0 = first = None
            topo = build_topology(settings.topology, src_prefix)
            metas: dict[str, PodMeta] = {}
            if scope.narrowed:  # which pods are in scope: every announcement up to the window's end
                async for msg in read_window(nc, topo, ["engine.announce.>"], end_time=window.end, prefix=src_prefix):
                    try:
                        a = decode_event(EngineAnnouncement, msg.data)
                    except ValidationFailure:
                        continue
                    metas[a.pod] = PodMeta(a.pool, a.model, a.role, a.node, tuple(a.devices))
            async for msg in read_window(nc, topo, subjects,
                                         start_time=window.start, end_time=window.end, start_seq=window.start_seq,
                                         prefix=src_prefix):
                if not keep_message(scope, msg.subject, msg.data, metas):
                    continue
                if speed > 0:
                    if first is None:
                        first, t0 = msg.ts, time.monotonic()
                    delay = (msg.ts - first) / speed - (time.monotonic() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                await bus.publish(js, S.with_prefix(dst_prefix, msg.subject), msg.data,
                                  msg_id=f"replay:{msg.stream}:{msg.seq}")
                n += 1
        finally:
            await nc.close()
        return n

    n = _run(go())
    console.print(f"republished {n} messages under {prefix}.")


def register(app: typer.Typer) -> None:
    app.add_typer(replay_app, name="replay")
