"""Strategy comparison: one table, one plot, one self-contained HTML page.

Used by ``infernex demo`` (HTTP replay) and ``infernex simulate`` (virtual time), so both
report the same figures the same way.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from simulator.workloads.metrics import Summary


@dataclass
class StrategyResult:
    strategy: str
    summary: Summary
    overlap_share: float | None = None  # chosen overlap / best available overlap, over requests
    busy_spread: float | None = None  # max / mean busy time per engine
    extra: dict = field(default_factory=dict)
    engine_hit_rate: float | None = None  # prefix-cache hits / queries counted by the engines (prefill side)

    @property
    def hit_rate(self) -> float | None:
        return self.engine_hit_rate if self.engine_hit_rate is not None else self.summary.hit_rate


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _shed(r: "StrategyResult") -> int:
    """Requests refused for load (HTTP 429/503) rather than failed."""
    return sum(n for k, n in r.summary.error_kinds.items() if k in ("http 429", "http 503"))


# one definition per figure; the header names where it is measured (see NOTES)
COLUMNS = [
    ("strategy", lambda r: r.strategy),
    ("ok/req", lambda r: f"{r.summary.ok}/{r.summary.requests}"),
    ("failed", lambda r: str(r.summary.requests - r.summary.ok - _shed(r))),
    ("shed", lambda r: str(_shed(r))),
    ("TTFT p50 ms (client)", lambda r: _ms(r.summary.ttft_p50_s)),
    ("TTFT p90 ms (client)", lambda r: _ms(r.summary.ttft_p90_s)),
    ("TTFT p99 ms (client)", lambda r: _ms(r.summary.ttft_p99_s)),
    ("ITL p50 ms", lambda r: _ms(r.summary.itl_p50_s)),
    ("ITL p99 ms", lambda r: _ms(r.summary.itl_p99_s)),
    ("req/s", lambda r: _f(r.summary.throughput_rps)),
    ("out tok/s", lambda r: _f(r.summary.output_tokens_per_s, "{:.0f}")),
    ("hit rate (engines)", lambda r: _f(r.hit_rate, "{:.1%}")),
    ("load spread", lambda r: _f(r.busy_spread if r.busy_spread is not None else r.summary.load_spread)),
    ("overlap chosen/best", lambda r: _f(r.overlap_share, "{:.1%}")),
]

NOTES = [
    "TTFT/ITL (client): measured by the replay client, from sending the request to the first token / "
    "between tokens, over the requests that succeeded",
    "failed: errors and timeouts; shed: refused for load (HTTP 429/503); both count as not ok",
    "hit rate (engines): prefix-cache hits / lookups counted by the engines (prefill side for PD)",
    "load spread: max/mean busy time per engine over the engines the strategy used",
    "overlap chosen/best: cached prefix blocks on the chosen backend / the best any backend had (router)",
]


def rich_table(results: list[StrategyResult], title: str) -> Table:
    t = Table(title=title)
    for name, _ in COLUMNS:
        t.add_column(name, justify="right" if name != "strategy" else "left")
    for r in results:
        t.add_row(*[fn(r) for _, fn in COLUMNS])
    return t


def markdown_table(results: list[StrategyResult]) -> str:
    head = "| " + " | ".join(n for n, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    rows = ["| " + " | ".join(fn(r) for _, fn in COLUMNS) + " |" for r in results]
    return "\n".join([head, sep, *rows])


def plot_png(results: list[StrategyResult], title: str) -> bytes:
    """Bars per strategy (strategies are categories, not a series): TTFT p50/p90/p99, hit
    rate, load spread. 9 x 3.4 inches at 100 dpi: 900 px wide, fits a laptop window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.strategy for r in results]
    x = list(range(len(names)))
    fig, axes = plt.subplots(1, 3, figsize=(9, 3.4), gridspec_kw={"width_ratios": [2, 1, 1]})
    width = 0.8 / 3
    for i, (q, key) in enumerate(((50, "ttft_p50_s"), (90, "ttft_p90_s"), (99, "ttft_p99_s"))):
        vals = [(getattr(r.summary, key) or 0) * 1000 for r in results]
        axes[0].bar([v + (i - 1) * width for v in x], vals, width, label=f"p{q}")
    axes[0].set_title("TTFT, client (ms)", fontsize=10)
    axes[0].legend(fontsize=8)
    axes[1].bar(x, [(r.hit_rate or 0) * 100 for r in results], color="#4c72b0")
    axes[1].set_title("hit rate, engines (%)", fontsize=10)
    axes[2].bar(x, [r.busy_spread if r.busy_spread is not None else (r.summary.load_spread or 0)
                    for r in results], color="#dd8452")
    axes[2].axhline(1.0, color="grey", lw=0.8)
    axes[2].set_title("load spread (max/mean)", fontsize=10)
    for ax in axes:
        ax.set_xticks(x, names, rotation=25, ha="right", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(title if len(title) <= 110 else title[:107] + "...", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def plot_timeline(runs: dict[str, list], *, lag_limit_s: float | None = None) -> bytes:
    """The run as time series, one line per strategy: TTFT (client) and how far the client fell
    behind the trace's schedule, against the scheduled send time. 9 x 4.2 inches at 100 dpi."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True)
    for strategy, reqs in runs.items():
        ok = sorted((r.scheduled_s, r.ttft_s * 1000) for r in reqs if r.status == "ok" and r.ttft_s is not None)
        if ok:
            top.plot([a for a, _ in ok], [b for _, b in ok], lw=0.9, label=strategy)
        lag = sorted((r.scheduled_s, r.start_s - r.scheduled_s) for r in reqs if r.start_s is not None)
        if lag:
            bottom.plot([a for a, _ in lag], [b for _, b in lag], lw=0.9, label=strategy)
    top.set_ylabel("TTFT, client (ms)", fontsize=8)
    top.set_yscale("log")
    top.legend(fontsize=7, ncol=4)
    bottom.set_ylabel("client behind\nschedule (s)", fontsize=8)
    if lag_limit_s is not None:
        bottom.axhline(lag_limit_s, color="red", lw=0.8, ls="--", label=f"validity limit {lag_limit_s:g} s")
        bottom.legend(fontsize=7, ncol=5)
    bottom.set_xlabel("scheduled send time in the run (s)", fontsize=8)
    return _png(fig, (top, bottom))


def plot_pd_loop(intervals: list, *, interval_s: float, attainment_goal: float | None = None) -> bytes:
    """The PD sizing loop over (virtual) time: offered load, engines per role (what ran in each
    interval, and what the planner asked for at its end), and SLA attainment. 9 x 5 inches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [i.k * interval_s / 60 for i in intervals]
    fig, (load, reps, att) = plt.subplots(3, 1, figsize=(9, 5), sharex=True)
    load.step(t, [i.rate for i in intervals], where="post", color="black", lw=1.2)
    load.set_ylabel("offered load\n(req/s)", fontsize=8)
    for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        reps.step(t, [i.engines.get(role, 0) for i in intervals], where="post", color=color, lw=1.4,
                  label=f"{role} engines running")
        hinted = [(x, i.hints[role]) for x, i in zip(t, intervals) if role in i.hints]
        if hinted:
            reps.plot([x + interval_s / 60 for x, _ in hinted], [h for _, h in hinted], "x", color=color, ms=5,
                      label=f"{role} hint (from ClickHouse history)")
    reps.set_ylabel("replicas", fontsize=8)
    reps.legend(fontsize=7, ncol=2)
    att.plot(t, [None if i.attainment is None else i.attainment * 100 for i in intervals], "o-", color="tab:green",
             ms=3, lw=1)
    if attainment_goal is not None:
        att.axhline(attainment_goal * 100, color="red", lw=0.8, ls="--", label=f"goal {attainment_goal:.0%}")
        att.legend(fontsize=7)
    att.set_ylim(0, 105)
    att.set_ylabel("SLA attainment\n(%)", fontsize=8)
    att.set_xlabel("virtual time (minutes)", fontsize=8)
    return _png(fig, (load, reps, att))


def _png(fig, axes) -> bytes:
    """Small tick labels, tight layout, the figure as PNG bytes at 100 dpi (and closed)."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


Section = tuple[str, list[str], list[list[str]]]  # heading, column names, rows of cells


def write_report(results: list[StrategyResult], out_dir: Path, *, title: str, notes: list[str] | None = None,
                 sections: list[Section] | None = None, verdicts: list[tuple[str, bool]] | None = None,
                 images: list[tuple[str, str, bytes]] | None = None) -> dict:
    """Write ``comparison.png``, ``report.html``, ``report.md`` and ``results.json``; return paths.
    ``sections``: more tables after the comparison (e.g. the demo's SLA history and incident)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    notes = [*NOTES, *(notes or [])]
    png = plot_png(results, title)
    (out_dir / "comparison.png").write_bytes(png)
    for name, _, data in images or []:
        (out_dir / name).write_bytes(data)
    md = f"# {title}\n\n" + "".join(f"**{t}**\n\n" for t, _ in verdicts or []) + markdown_table(results) + "\n"
    if notes:
        md += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    md += "".join(f"\n![{cap}]({name})\n" for name, cap, _ in images or [])
    sections_html = ""
    for heading, cols, rows in sections or []:
        md += f"\n## {heading}\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
        md += "".join("| " + " | ".join(c.replace("|", "/") for c in row) + " |\n" for row in rows)
        sections_html += (f"<h2>{html.escape(heading)}</h2><table><tr>"
                          + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>"
                          + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                                    for row in rows) + "</table>")
    (out_dir / "report.md").write_text(md)
    rows_html = "".join(
        "<tr>" + "".join(f"<td>{html.escape(fn(r))}</td>" for _, fn in COLUMNS) + "</tr>" for r in results
    )
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes or [])
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font-family:sans-serif;margin:1em auto;max-width:1100px;padding:0 1em}}
table{{border-collapse:collapse;display:block;overflow-x:auto;font-size:90%}}img{{max-width:100%;height:auto}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}td:first-child{{text-align:left}}
.verdict{{padding:.5em 1em;border-left:4px solid #2a2}}.invalid{{border-color:#c22;background:#fee}}</style></head>
<body><h1>{html.escape(title)}</h1>
{"".join(f'<p class="verdict{" invalid" if bad else ""}">{html.escape(text)}</p>' for text, bad in verdicts or [])}
<table><tr>{''.join(f'<th>{html.escape(n)}</th>' for n, _ in COLUMNS)}</tr>{rows_html}</table>
<ul>{notes_html}</ul>
<img alt="comparison plot" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>
{"".join(f'<h2>{html.escape(cap)}</h2><img alt="{html.escape(cap)}" src="data:image/png;base64,{base64.b64encode(data).decode()}"/>' for _, cap, data in images or [])}
{sections_html}
</body></html>
"""
    (out_dir / "report.html").write_text(page)
    data = [
        {"strategy": r.strategy, "summary": r.summary.model_dump(), "overlap_share": r.overlap_share,
         "busy_spread": r.busy_spread, "hit_rate": r.hit_rate, **({"extra": r.extra} if r.extra else {})}
        for r in results
    ]
    (out_dir / "results.json").write_text(json.dumps(data, indent=2))
    return {k: str(out_dir / v) for k, v in
            {"png": "comparison.png", "html": "report.html", "md": "report.md", "json": "results.json"}.items()}
