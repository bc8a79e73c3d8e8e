"""``up``, ``streams apply|info``, ``pub`` and ``tail``."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from infernex.commands.common import busy_port, fail, parse_since, port_in_use
from infernex.commands.common import run_async as _run
from rich.table import Table

from consumers import bus
from infernex.embedded_nats import EmbeddedNats, NatsBinaryMissing
from infernex.settings import Settings
from schemas import ValidationFailure, decode_event
from schemas import subjects as S
from schemas.registry import model_for_subject
from streams.topology import build_topology

console = Console()
err = Console(stderr=True)

streams_app = typer.Typer(help="JetStream topology: apply and inspect the streams.", no_args_is_help=True)


def _settings(ctx: typer.Context) -> Settings:
    from infernex.cli import settings_of

    return settings_of(ctx)


def _topology(settings: Settings):
    return build_topology(settings.topology, settings.nats.subject_prefix)


async def _apply(settings: Settings):
    nc = await bus.connect(settings.nats)
    try:
        return await bus.apply_topology(nc.jetstream(), _topology(settings))
    finally:
        await nc.drain()


async def _info(settings: Settings):
    nc = await bus.connect(settings.nats)
    try:
        return await bus.topology_info(nc.jetstream(), _topology(settings))
    finally:
        await nc.drain()


@streams_app.command("apply")
def streams_apply(ctx: typer.Context) -> None:
    """Create or update every stream; idempotent."""
    results = _run(_apply(_settings(ctx)))
    for r in results:
        console.print(f"{r.stream:<20} {r.action}")


@streams_app.command("info")
def streams_info(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """Show the streams with message counts."""
    rows = _run(_info(_settings(ctx)))
    if as_json:
        console.print_json(json.dumps(rows))
        return
    table = Table(title="JetStream streams")
    for col in ("stream", "subjects", "messages", "bytes", "last seq", "consumers", "max age", "replicas"):
        table.add_column(col)
    for r in rows:
        if not r["exists"]:
            table.add_row(r["stream"], ", ".join(r["subjects"]), "[red]missing[/red]", "", "", "", "", "")
            continue
        table.add_row(r["stream"], ", ".join(r["subjects"]), str(r["messages"]), str(r["bytes"]),
                      str(r["last_seq"]), str(r["consumers"]), f"{r['max_age_s'] / 3600:g}h", str(r["replicas"]))
    console.print(table)


def _read_payload(payload: str) -> bytes:
    if payload == "-":
        return sys.stdin.buffer.read()
    if payload.startswith("@"):
        path = Path(payload[1:])
        try:
            return path.read_bytes()
        except OSError as exc:
            fail(f"cannot read {path}: {exc.strerror or exc} (give JSON text, @FILE of a readable file, "
                 "or - for stdin)", code=2)
    return payload.encode()


def pub(
    ctx: typer.Context,
    subject: str = typer.Argument(..., help="concrete subject, e.g. kv.events.my-model.pod-1"),
    payload: str = typer.Argument(..., help="JSON text, @file, or - for stdin"),
    msg_id: Optional[str] = typer.Option(None, "--msg-id", help="Nats-Msg-Id for de-duplication"),
) -> None:
    """Validate a JSON event against its subject's schema and publish it."""
    settings = _settings(ctx)
    data = _read_payload(payload)
    try:
        model = model_for_subject(subject)
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    try:
        event = decode_event(model, data)
    except ValidationFailure as exc:
        err.print(f"[red]invalid event:[/red] {exc}")
        raise typer.Exit(2) from None

    async def go():
        nc = await bus.connect(settings.nats)
        try:
            ack = await bus.publish(nc.jetstream(), S.with_prefix(settings.nats.subject_prefix, subject),
                                    event.to_json(), msg_id=msg_id)
            return ack
        finally:
            await nc.drain()

    ack = _run(go())
    console.print(f"published to {ack.stream} seq {ack.seq}" + (" (duplicate)" if ack.duplicate else ""))


__all__ = ["parse_since"]  # the one parser lives in infernex.commands.common


def format_event(subject: str, data: bytes, seq: int | None, raw: bool) -> str:
    head = f"[{seq}] " if seq is not None else ""
    from schemas import kv_binary

    if kv_binary.is_group(data):  # several batches in one message: a line each
        try:
            parts = kv_binary.split(data) or [data]
        except ValueError as exc:
            return f"{head}{subject} <undecodable binary group: {exc}> {data[:200]!r}"
        return "\n".join(format_event(subject, p, seq, raw) for p in parts)
    if raw:
        if kv_binary.is_binary(data):  # binary KV batches are shown as their JSON, never as msgpack bytes
            try:
                return f"{head}{subject} {json.dumps(kv_binary.to_dict(kv_binary.decode(data)), separators=(',', ':'))}"
            except ValueError as exc:
                return f"{head}{subject} <undecodable binary: {exc}> {data[:200]!r}"
        return f"{head}{subject} {data.decode(errors='replace')}"
    try:
        model = model_for_subject(subject)
        event = model.from_bytes(data) if hasattr(model, "from_bytes") else decode_event(model, data)
        body = event.model_dump(mode="json", exclude_none=True)
        body.pop("schema_version", None)
        return f"{head}{subject} {model.__name__} {json.dumps(body, separators=(',', ':'))}"
    except (ValueError, ValidationFailure) as exc:
        return f"{head}{subject} <undecodable: {exc}> {data[:200]!r}"


def tail(
    ctx: typer.Context,
    subjects: list[str] = typer.Argument(..., help="subjects or wildcards, e.g. 'kv.events.>'"),
    since: Optional[str] = typer.Option(None, "--since", help="start at a time: 10m, 1h30m, 2d ago, or ISO-8601"),
    from_seq: Optional[int] = typer.Option(None, "--from-seq", help="start at a stream sequence"),
    new_only: bool = typer.Option(False, "--new", help="only messages published from now on"),
    raw: bool = typer.Option(False, "--raw", help="print payloads as they are"),
    limit: Optional[int] = typer.Option(None, "--limit", "-n", help="stop after N messages"),
) -> None:
    """Follow subjects and print events readably (stored history first, then live)."""
    settings = _settings(ctx)
    prefix = settings.nats.subject_prefix
    topo = _topology(settings)
    start_time = parse_since(since) if since is not None else None  # a bad value fails before connecting

    async def go():
        from nats.js.api import DeliverPolicy

        nc = await bus.connect(settings.nats)
        js = nc.jetstream()
        queue: asyncio.Queue = asyncio.Queue()
        subs = []
        from streams.topology import history_filters

        for subj in subjects:
            full = S.with_prefix(prefix, subj)
            # a wildcard may span streams (router.> = requests + decisions): history from each part
            parts = history_filters(topo, full)
            if not parts:
                subs.append(await nc.subscribe(full, cb=queue.put))
                continue
            kw = {}
            if from_seq is not None:
                kw = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": from_seq}
            elif since is not None:
                kw = {"deliver_policy": DeliverPolicy.BY_START_TIME,
                      "opt_start_time": start_time.isoformat().replace("+00:00", "Z")}
            elif new_only:
                kw = {"deliver_policy": DeliverPolicy.NEW}
            else:
                kw = {"deliver_policy": DeliverPolicy.ALL}
            from nats.js.api import ConsumerConfig

            for spec, part in parts:
                subs.append(await js.subscribe(part, cb=queue.put, ordered_consumer=True, stream=spec.name,
                                               config=ConsumerConfig(**kw)))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        n = 0
        try:
            while not stop.is_set():
                getter = asyncio.ensure_future(queue.get())
                stopper = asyncio.ensure_future(stop.wait())
                done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                stopper.cancel()
                msg = getter.result()
                seq = msg.metadata.sequence.stream if msg.reply and msg.reply.startswith("$JS.ACK") else None
                subj = msg.subject[len(prefix) + 1:] if prefix else msg.subject
                print(format_event(subj, msg.data, seq, raw), flush=True)
                n += 1
                if limit is not None and n >= limit:
                    break
        finally:
            await nc.close()

    _run(go())


def up(
    ctx: typer.Context,
    port: int = typer.Option(4222, "--port", help="NATS port (0 for a free one)"),
    store_dir: Optional[Path] = typer.Option(None, "--store-dir", help="JetStream store directory"),
) -> None:
    """Start the local all-in-one: embedded NATS with the topology applied. Ctrl-C stops it."""
    settings = _settings(ctx)
    store = store_dir or settings.embedded_nats.store_dir
    host = settings.embedded_nats.host
    if port_in_use(host, port):
        fail(busy_port("cannot start NATS", host, port))
    try:
        server = EmbeddedNats(store, host=host, port=port, binary=settings.embedded_nats.binary)
    except NatsBinaryMissing as exc:
        fail(str(exc))
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        lines = [ln for ln in str(exc).splitlines() if "[FTL]" in ln or "[ERR]" in ln]
        reason = lines[-1].split("]", 2)[-1].strip() if lines else str(exc).splitlines()[0]
        if "address already in use" in reason:
            fail(busy_port("cannot start NATS", host, port))
        fail(f"nats-server did not start: {reason} (log: {server.log_file})")
    try:
        local = settings.model_copy(update={"nats": settings.nats.model_copy(update={"servers": [server.url]})})
        results = _run(_apply(local))
        console.print(f"[green]NATS JetStream ready[/green] at {server.url} (store {store})")
        for r in results:
            console.print(f"  stream {r.stream:<18} {r.action}")
        console.print(f"export INFERNEX_NATS__SERVERS={server.url}   # for other infernex commands")
        console.print("Ctrl-C to stop.")
        stop = {"flag": False}

        def _stop(*_):
            stop["flag"] = True

        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
        while not stop["flag"]:
            if server.proc is None or server.proc.poll() is not None:
                err.print("[red]nats-server exited[/red]")
                raise typer.Exit(1)
            time.sleep(0.2)
    finally:
        server.stop()
        console.print("stopped.")


def register(app: typer.Typer) -> None:
    app.add_typer(streams_app, name="streams")
    app.command()(pub)
    app.command()(tail)
    app.command()(up)
