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
    num_gpu_blocks: Optional[int] = typer.Option(None, "--num-gpu-blocks", help="KV blocks per engine"),
    limit: Optional[int] = typer.Option(None, "--limit", help="first N requests"),
    time_scale: float = typer.Option(1.0, "--time-scale", help="arrivals at timestamp / K"),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(Path("infernex-simulate"), "--out", help="report directory"),
) -> None:
    """Run the router's strategies over simulated engines in virtual time and compare them."""
    from infernex.report import StrategyResult, rich_table, write_report
    from infernex.whatif import Fleet, simulate as run
    from simulator.workloads import TraceFormatError, load_trace

    try:
        rows = load_trace(trace, limit=limit)
    except (TraceFormatError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    fleet = Fleet(aggregated=engines, pd_groups=pd_groups, prefill_per_group=prefill, decode_per_group=decode,
                  hardware=hardware, model_profile=model_profile, num_gpu_blocks=num_gpu_blocks)
    results = []
    for prof in profiles:
        try:
            r = run(rows, prof, fleet, time_scale=time_scale, seed=seed)
        except (ValueError, FileNotFoundError) as exc:
            console.print(f"[red]{prof}: {exc}[/red]")
            raise typer.Exit(2) from None
        console.print(f"{prof}: {len(rows)} requests in {r.wall_s:.2f}s wall "
                      f"({len(rows) / max(r.wall_s, 1e-9):.0f} req/s), {r.virtual_s:.0f}s virtual")
        results.append(StrategyResult(prof, r.summary(), r.overlap_share, r.busy_spread,
                                      {"wall_s": r.wall_s, "virtual_s": r.virtual_s, "rejected": r.rejected}))
    title = f"What-if: {trace.name}, {len(rows)} requests, {engines} engines + {pd_groups} PD groups ({hardware})"
    console.print(rich_table(results, title))
    paths = write_report(results, out, title=title,
                         notes=["virtual time; the KV view is exact and without event lag"])
    console.print(f"report: {paths['html']}")


def register(app: typer.Typer) -> None:
    app.command()(simulate)
