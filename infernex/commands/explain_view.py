"""Tables for ``infernex replay explain`` (rendering only; the data comes from
:func:`infernex.incident.explain_request`)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _f(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def render(console: Console, ex: dict[str, Any]) -> None:
    ok = "[green]reproduced exactly[/green]" if ex["reproduced"] else "[red]NOT reproduced[/red]"
    console.print(f"request [bold]{ex['request_id']}[/bold] at {ex.get('at_iso', ex['at'])}  pool {ex['pool']}  "
                  f"model {ex['model']}  profile {ex['profile']}  ({ok}"
                  f"{'; a recorded random tie-break decided' if ex['random_draw_used'] else ''})")
    for d in ex["differences"]:
        console.print(f"  [red]{d}[/red]")
    for st in ex["stages"]:
        scorers: list[str] = []
        for c in st["candidates"]:
            for k in c["scores"]:
                if k not in scorers:
                    scorers.append(k)
        t = Table(title=f"{st['stage']}: picked {st['picked']}", title_justify="left")
        t.add_column("pod")
        t.add_column("total", justify="right")
        for k in scorers:
            t.add_column(k, justify="right")
        t.add_column("cached blocks", justify="right")
        t.add_column("filtered by")
        for c in st["candidates"]:
            mark = "* " if c["pod"] == st["picked"] else "  "
            t.add_row(mark + c["pod"], _f(c["total"]), *[_f(c["scores"].get(k)) for k in scorers],
                      str(c["overlap_blocks"]), c["filtered_by"] or "")
        console.print(t)
        alt = st.get("best_alternative")
        if alt:
            behind = ", ".join(f"{k} -{v:.3f}" for k, v in alt["behind_on"].items()) or "nothing"
            ahead = ", ".join(f"{k} +{v:.3f}" for k, v in alt["ahead_on"].items()) or "nothing"
            console.print(f"best alternative {alt['pod']}: total {alt['total']:.3f} ({alt['margin']:.3f} behind); "
                          f"behind on {behind}; ahead on {ahead}")
    pre = ex["prefix"]
    t = Table(title=f"prompt prefix: {pre['prompt_tokens']} tokens, {pre['request_blocks']} blocks of "
                    f"{pre['block_size']}", title_justify="left")
    t.add_column("pod")
    t.add_column("cached blocks (router read)", justify="right")
    t.add_column("in the index at T (history)", justify="right")
    for pod, v in pre["per_pod"].items():
        t.add_row(pod, str(v["recorded"]), _f(v.get("index_at_t")))
    console.print(t)
    if pre.get("index_left_out"):
        console.print(f"in the index at T: {pre['index_left_out']}")
    t = Table(title="backends as the router read them", title_justify="left")
    for col in ("pod", "waiting", "running", "kv", "cpu", "mem", "inflight", "health", "history differs"):
        t.add_column(col)
    for pod, b in ex["backends"].items():
        diff = "; ".join(f"{k}: {_f(v['history'])}" for k, v in (b.get("history_differs") or {}).items())
        t.add_row(pod, _f(b["waiting"], 0), _f(b["running"], 0), _f(b["kv_usage"], 2), _f(b["cpu_util"], 2),
                  _f(b["mem_util"], 2), str(b["inflight"]), b["health"], diff)
    console.print(t)
    if ex["findings"]:
        console.print("findings in force:")
        for f in ex["findings"]:
            console.print(f"  {f['pod']}: {f['severity']} {f['fault_mode']} on {f['node']}/{f['device']} since "
                          f"{f['since']} (action {f['action']})")
    else:
        console.print("findings in force: none")
    o = ex.get("other_profile")
    if o:
        same = "the same pick" if o["same_pick"] else "a different pick"
        console.print(f"under {o['profile']}: {o['status']}, picked {o['picked']} ({same}): {o['reason']}")
        if o.get("note"):
            console.print(f"  note: {o['note']}")
