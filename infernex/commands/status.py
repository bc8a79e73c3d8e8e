"""``infernex status``: one view of the running system.

NATS, the streams, every durable consumer's lag, dead letters (count and the latest), the
router's backends, the indexer's pods, the latest findings and replica hints. Each part is
gathered on its own with a short timeout: a part that cannot be read says why and the rest
still shows. Exit code 1 when NATS is unreachable, 0 otherwise.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Optional

import typer

LATEST = 5  # findings, hints and dead letters shown


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


async def _http_json(url: str, timeout_s: float) -> tuple[Any, str | None]:
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.get(url) as r:
                if r.status != 200:
                    return None, f"HTTP {r.status}"
                return await r.json(), None
    except aiohttp.ClientConnectorError as exc:
        return None, f"not reachable ({exc.os_error.strerror or exc.os_error})"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return None, f"not reachable ({type(exc).__name__}{': ' + str(exc) if str(exc) else ''})"[:200]


async def _latest(js, stream: str, last_seq: int, first_seq: int, n: int) -> list[tuple[str, bytes]]:  # noqa: ANN001
    """The last ``n`` messages of ``stream`` (subject, data), newest first."""
    from nats.js.errors import NotFoundError

    out: list[tuple[str, bytes]] = []
    seq = last_seq
    tries = 0
    while seq >= max(first_seq, 1) and len(out) < n and tries < n * 4:
        tries += 1
        try:
            msg = await js.get_msg(stream, seq)
            out.append((msg.subject, msg.data))
        except NotFoundError:  # deleted or aged out
            pass
        seq -= 1
    return out


def _strip(prefix: str | None, subject: str) -> str:
    return subject[len(prefix) + 1:] if prefix and subject.startswith(prefix + ".") else subject


async def gather(settings, *, router_url: str | None, indexer_url: str | None,  # noqa: ANN001
                 timeout_s: float = 2.0, latest: int = LATEST) -> dict[str, Any]:
    """Everything the status view shows, as plain data (what ``--json`` prints)."""
    from consumers import bus
    from schemas import ValidationFailure, decode_event
    from schemas.registry import model_for_subject
    from streams.topology import build_topology

    prefix = settings.nats.subject_prefix
    topo = build_topology(settings.topology, prefix)
    names = {base.name: spec.name for base, spec in zip(build_topology(settings.topology, None), topo)}
    out: dict[str, Any] = {"time": time.time(), "nats": {"servers": list(settings.nats.servers), "ok": False}}
    r_url = router_url or f"http://{_local(settings.router.host)}:{settings.router.port}"
    i_url = indexer_url or (f"http://{_local(settings.indexer.http_host)}:{settings.indexer.http_port}"
                            if settings.indexer.http_port else None)
    http = asyncio.gather(_http_json(r_url.rstrip("/") + "/v1/router/backends", timeout_s),
                          _http_json(i_url.rstrip("/") + "/v1/index/pods", timeout_s) if i_url
                          else asyncio.sleep(0, (None, "no indexer.http_port")))
    cfg = settings.nats.model_copy(update={"connect_timeout_s": min(settings.nats.connect_timeout_s, timeout_s),
                                           "max_reconnect_attempts": 0})
    try:
        nc = await bus.connect(cfg, name="infernex-status")
    except ConnectionError as exc:
        out["nats"]["error"] = str(exc)
        nc = None
    if nc is not None:
        try:
            js = nc.jetstream()
            info = getattr(nc, "_server_info", {}) or {}
            out["nats"].update(ok=True, server=nc.connected_url.netloc if nc.connected_url else None,
                               version=info.get("version"))
            out["streams"] = await bus.topology_info(js, topo)
            consumers = []
            for row in out["streams"]:
                if not row["exists"]:
                    continue
                for ci in await js.consumers_info(row["stream"]):
                    active = ci.delivered.last_active if ci.delivered else None
                    consumers.append({
                        "stream": row["stream"], "name": ci.name,
                        "lag": int(ci.num_pending or 0) + int(ci.num_ack_pending or 0),
                        "pending": int(ci.num_pending or 0), "ack_pending": int(ci.num_ack_pending or 0),
                        "redelivered": int(ci.num_redelivered or 0),
                        "last_active": active.isoformat() if hasattr(active, "isoformat") else active,
                    })
            out["consumers"] = sorted(consumers, key=lambda c: -c["lag"])
            by_name = {r["stream"]: r for r in out["streams"] if r["exists"]}

            async def last_events(short: str) -> list[dict]:
                row = by_name.get(names.get(short, short))
                if row is None:
                    return []
                events = []
                for subject, data in await _latest(js, row["stream"], row["last_seq"], row["first_seq"], latest):
                    subj = _strip(prefix, subject)
                    try:
                        ev = decode_event(model_for_subject(subj), data).model_dump(mode="json")
                        ev.pop("schema_version", None)
                    except (ValueError, ValidationFailure) as exc:
                        ev = {"undecodable": str(exc)[:200]}
                    events.append({"subject": subj, **ev})
                return events

            dlq = by_name.get(names.get("DLQ", "DLQ"))
            letters = await last_events("DLQ")
            for d in letters:
                d.pop("payload", None)  # base64 of the bad input: not for a status view
                d.pop("headers", None)
            out["dead_letters"] = {"total": dlq["messages"] if dlq else None, "latest": letters}
            out["findings"] = await last_events("DIAGNOSIS")
            out["hints"] = await last_events("AUTOSCALE")
        except Exception as exc:  # noqa: BLE001 - a status view shows what failed and goes on
            out["nats"]["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            await nc.close()
    (rb, rerr), (ip, ierr) = await http
    out["router"] = {"url": r_url, "ok": rerr is None, **({"error": rerr} if rerr else {}),
                     **({"strategy": rb.get("strategy"), "pool": rb.get("pool"), "backends": rb.get("backends", [])}
                        if rb else {})}
    out["indexer"] = {"url": i_url, "ok": ierr is None, **({"error": ierr} if ierr else {}),
                      **({"pods": ip.get("pods", {})} if ip else {})}
    return out


def _ago(ts: float | None, now: float) -> str:
    if not ts:
        return "-"
    d = max(0.0, now - ts)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago" if d < 7200 else f"{d / 3600:.1f}h ago"


def render(data: dict[str, Any], console) -> None:  # noqa: ANN001
    from rich.table import Table

    now = data["time"]
    n = data["nats"]
    if n["ok"]:
        console.print(f"[green]NATS[/green] {n.get('server')} (nats-server {n.get('version') or '?'})")
    else:
        console.print(f"[red]NATS down[/red]: {n.get('error', 'not reachable')}", soft_wrap=True)
    if data.get("streams"):
        t = Table(title="Streams", title_justify="left")
        for c in ("stream", "messages", "bytes", "last seq", "consumers"):
            t.add_column(c, justify="left" if c == "stream" else "right")
        for r in data["streams"]:
            if r["exists"]:
                t.add_row(r["stream"], str(r["messages"]), str(r["bytes"]), str(r["last_seq"]), str(r["consumers"]))
            else:
                t.add_row(r["stream"], "[red]missing[/red] (infernex streams apply)", "", "", "")
        console.print(t)
    if "consumers" in data:
        t = Table(title="Durable consumers (lag = not yet delivered + unacknowledged)", title_justify="left")
        for c in ("stream", "consumer", "lag", "redelivered", "last active"):
            t.add_column(c, justify="left" if c in ("stream", "consumer", "last active") else "right")
        for c in data["consumers"]:
            colour = "red" if c["lag"] > 10_000 else "yellow" if c["lag"] > 100 else "green"
            t.add_row(c["stream"], c["name"], f"[{colour}]{c['lag']}[/{colour}]", str(c["redelivered"]),
                      str(c["last_active"] or "-"))
        console.print(t if data["consumers"] else "Durable consumers: none")
    if "dead_letters" in data:
        dl = data["dead_letters"]
        colour = "green" if not dl["total"] else "red"
        console.print(f"Dead letters: [{colour}]{dl['total']}[/{colour}]")
        for d in dl["latest"]:
            console.print(f"  {_ago(d.get('ts'), now):>9}  {d.get('stream')} {d.get('subject')} "
                          f"({d.get('consumer') or '?'}): {str(d.get('reason'))[:120]}", soft_wrap=True,
                          highlight=False)
    r = data["router"]
    if r["ok"]:
        t = Table(title=f"Router {r['url']} (strategy {r.get('strategy')}, pool {r.get('pool')})",
                  title_justify="left")
        for c in ("pod", "role", "health", "circuit", "cached blocks", "findings"):
            t.add_column(c)
        for b in r.get("backends", []):
            t.add_row(str(b.get("pod")), str(b.get("role", "")), str(b.get("health", "")), str(b.get("circuit", "")),
                      str(b.get("cached_blocks", "")), "; ".join(map(str, b.get("findings") or [])) or "-")
        console.print(t)
    else:
        console.print(f"Router {r['url']}: [yellow]{r['error']}[/yellow] (--router URL)")
    i = data["indexer"]
    if i["ok"]:
        t = Table(title=f"Indexer {i['url']}", title_justify="left")
        for c in ("pod", "model", "blocks", "live", "last event"):
            t.add_column(c)
        for pod, p in sorted(i.get("pods", {}).items()):
            t.add_row(pod, str(p.get("model")), str(p.get("total_blocks")), "yes" if p.get("live") else "[red]no[/red]",
                      _ago(p.get("last_event_ts"), now))
        console.print(t)
    else:
        console.print(f"Indexer {i['url']}: [yellow]{i['error']}[/yellow] (--indexer URL)")
    if "findings" in data:
        console.print("Latest findings:" + ("" if data["findings"] else " none"))
        for f in data["findings"]:
            console.print(f"  {_ago(f.get('last_seen'), now):>9}  {f.get('severity', '?'):<8} {f.get('node')}/"
                          f"{f.get('device')} {f.get('fault_mode')} [{f.get('status')}] -> {f.get('action')}: "
                          f"{str(f.get('summary', ''))[:100]}", soft_wrap=True, highlight=False)
    if "hints" in data:
        console.print("Latest replica hints:" + ("" if data["hints"] else " none"))
        for h in data["hints"]:
            console.print(f"  {_ago(h.get('ts'), now):>9}  {h.get('pool')}/{h.get('role')}: {h.get('current')} -> "
                          f"{h.get('desired')} ({h.get('mode')}) {str(h.get('reason', ''))[:100]}", soft_wrap=True,
                          highlight=False)


def status(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="print the data as JSON"),
    router: Optional[str] = typer.Option(None, "--router", help="router base URL (default: from the settings)"),
    indexer: Optional[str] = typer.Option(None, "--indexer", help="indexer base URL (default: from the settings)"),
    timeout: float = typer.Option(2.0, "--timeout", min=0.1, help="seconds to wait for each part"),
) -> None:
    """One view of the system: NATS, streams, consumer lag, dead letters, router backends,
    indexer pods, latest findings and hints."""
    from rich.console import Console

    from infernex.cli import settings_of

    data = asyncio.run(gather(settings_of(ctx), router_url=router, indexer_url=indexer, timeout_s=timeout))
    if as_json:
        print(json.dumps(data, default=str))
    else:
        render(data, Console())
    if not data["nats"]["ok"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("status")(status)
