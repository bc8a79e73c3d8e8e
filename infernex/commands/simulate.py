"""``infernex simulate``: what-if runs of routing strategies over a trace, in virtual time."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console()


def simulate(
    trace: Path = typer.Option(..., "--trace", help="Mooncake-format trace (jsonl)"),
    profiles: list[str] = typer.Option(["round-robin", "least-load", "kv-aware"], "--profile", "-p",
                                       help="strategy profile(s): built-in name or YAML file; repeat"),
    engines: int = typer.Option(8, "--engines", help="aggregated engines"),
    pd_groups: int = typer.Option(0, "--pd-groups", help="PD groups (xPyD) for pd-* profiles"),
    prefill: int = typer.Option(2, "--prefill-per-group"),
    decode: int = typer.Option(2, "--decode-per-group"),
    hardware: str = typer.Option("h100", "--hardware", help="h100, ascend-910b4, ..."),
    model_profile: str = typer.Option("llama-3.1-8b", "--model-profile"),
    num_gpu_blocks: Optional[int] = typer.Option(None, "--num-gpu-blocks",
                                                help="KV blocks of 16 tokens per engine (either KV model)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="first N requests (after --skip)"),
    skip: int = typer.Option(0, "--skip", min=0, help="leave out the first N requests of the trace"),
    max_output_tokens: Optional[int] = typer.Option(None, "--max-output-tokens", min=1,
                                                    help="cap each request's output (the demo uses 64)"),
    time_scale: float = typer.Option(1.0, "--time-scale", help="arrivals at timestamp / K"),
    metrics_interval: float = typer.Option(
        5.0, "--metrics-interval", min=0.0,
        help="virtual seconds between scrapes of the engines' load, as the metrics collector gives it to the "
             "router (default: `infernex collect metrics`' default interval; 0: exact at every decision, "
             "which flatters strategies that read the engines' load)"),
    seed: int = typer.Option(0, "--seed"),
    kv_model: str = typer.Option(
        "coarse", "--kv-model",
        help="coarse: KV cache in units of one trace block (512 tokens, matched by hash id; ~10x faster); "
             "fine: vLLM's 16-token blocks over synthesized prompt tokens"),
    out: Path = typer.Option(Path("infernex-simulate"), "--out", help="report directory"),
) -> None:
    """Run the router's strategies over simulated engines in virtual time and compare them."""
    from infernex.report import StrategyResult, rich_table, write_report
    from simulator.whatif import Fleet, simulate as run
    from simulator.workloads import TraceFormatError, load_trace

    if kv_model not in ("coarse", "fine"):
        console.print(f"[red]--kv-model must be coarse or fine, not {kv_model!r}[/red]")
        raise typer.Exit(2)
    try:
        rows = load_trace(trace, limit=None if limit is None else skip + limit)[skip:]
    except (TraceFormatError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    fleet = Fleet(aggregated=engines, pd_groups=pd_groups, prefill_per_group=prefill, decode_per_group=decode,
                  hardware=hardware, model_profile=model_profile, num_gpu_blocks=num_gpu_blocks,
                  kv_model=kv_model)
    results, runs = [], []
    for prof in profiles:
        try:
            r = run(rows, prof, fleet, time_scale=time_scale, seed=seed, max_output_tokens=max_output_tokens,
                    metrics_interval_s=metrics_interval)
        except (ValueError, FileNotFoundError) as exc:
            console.print(f"[red]{prof}: {exc}[/red]")
            raise typer.Exit(2) from None
        runs.append(r)
        console.print(f"{prof}: {len(rows)} requests in {r.wall_s:.2f}s wall "
                      f"({len(rows) / max(r.wall_s, 1e-9):.0f} req/s), {r.virtual_s:.0f}s virtual")
        results.append(StrategyResult(prof, r.summary(), r.overlap_share, r.busy_spread,
                                      {"wall_s": r.wall_s, "virtual_s": r.virtual_s, "rejected": r.rejected},
                                      engine_hit_rate=r.engine_hit_rate))
    caps = sorted({c for r in runs for c in r.extra["kv_capacity_tokens"].values()})
    title = (f"What-if: {trace.name}, {len(rows)} requests, {engines} engines + {pd_groups} PD groups "
             f"({hardware}, {kv_model} KV model)")
    console.print(rich_table(results, title))
    paths = write_report(results, out, title=title,
                         notes=["virtual time; the KV view is exact and without event lag",
                                (f"engines' load scraped every {metrics_interval:g} virtual s" if metrics_interval
                                 else "engines' load exact at every decision"),
                                f"KV model: {kv_model} (see simulator/whatif.py)",
                                "KV cache per engine: " + ", ".join(f"{c:,} tokens" for c in caps)])
    console.print(f"report: {paths['html']}")


def register(app: typer.Typer) -> None:
    app.command()(simulate)
