"""``replay-trace``, ``gen-workload`` and ``trace-stats``: workloads and the replay client."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from simulator.workloads.generators import KINDS, WorkloadParams, generate
from simulator.workloads.metrics import Summary
from simulator.workloads.trace import TraceFormatError, load_trace, trace_stats, write_trace

console = Console()
err = Console(stderr=True)


def _load(path: Path, limit: int | None = None, block_tokens: int | None = None):
    try:
        return load_trace(path, limit=limit, block_tokens=block_tokens)
    except (TraceFormatError, FileNotFoundError) as exc:
        err.print(str(exc), style="red", markup=False, highlight=False)
        raise typer.Exit(2) from None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def summary_table(summary: Summary, title: str = "replay") -> Table:
    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("requests (ok / errors / timeouts)", f"{summary.requests} ({summary.ok} / {summary.errors} / {summary.timeouts})"),
        ("duration s", f"{summary.duration_s:.2f}"),
        ("throughput req/s", "-" if summary.throughput_rps is None else f"{summary.throughput_rps:.2f}"),
        ("output tok/s", "-" if summary.output_tokens_per_s is None else f"{summary.output_tokens_per_s:.1f}"),
        ("TTFT p50 / p90 / p99 ms", f"{_ms(summary.ttft_p50_s)} / {_ms(summary.ttft_p90_s)} / {_ms(summary.ttft_p99_s)}"),
        ("ITL p50 / p99 ms", f"{_ms(summary.itl_p50_s)} / {_ms(summary.itl_p99_s)}"),
        ("E2E p50 / p90 ms", f"{_ms(summary.e2e_p50_s)} / {_ms(summary.e2e_p90_s)}"),
        ("prefix cache hit rate", "-" if summary.hit_rate is None else f"{summary.hit_rate:.1%}"
         + f" ({summary.usage_reported} reported)"),
        ("max send lag ms", _ms(summary.max_start_lag_s)),
    ]
    if summary.load_spread is not None:
        rows.append(("load spread (max/mean)", f"{summary.load_spread:.2f}"))
    for kind, n in summary.error_kinds.items():
        rows.append((f"error: {kind}", str(n)))
    for r in rows:
        t.add_row(*r)
    return t


def replay_trace(
    trace: Path = typer.Option(..., "--trace", "-t", help="Mooncake-format trace (.jsonl / .json, optionally .gz)"),
    url: str = typer.Option(..., "--url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000"),
    time_scale: float = typer.Option(1.0, "--time-scale", help="multiply trace time by K (0.1 = ten times faster)"),
    limit: Optional[int] = typer.Option(None, "--limit", "-n", help="replay only the first N requests"),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", "-C", help="cap on requests in flight"),
    model: Optional[str] = typer.Option(None, "--model", help="model name (default: first of /v1/models)"),
    out: Path = typer.Option(Path("replay-result.json"), "--out", "-o", help="JSON result file"),
    prompt: str = typer.Option("tokens", "--prompt", help="send prompts as 'tokens' (ids) or 'text'"),
    api: str = typer.Option("completions", "--api", help="'completions' or 'chat'"),
    timeout_s: float = typer.Option(600.0, "--timeout", help="per-request limit in seconds"),
    block_tokens: int = typer.Option(512, "--block-tokens", help="tokens per trace hash id"),
    seed: int = typer.Option(0, "--seed", help="prompt synthesis seed"),
    vocab_lo: int = typer.Option(1000, "--vocab-lo", help="lowest synthesized token id"),
    vocab_hi: int = typer.Option(32000, "--vocab-hi", help="one past the highest synthesized token id"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="ask for exactly output_length tokens"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="INFERNEX_REPLAY_API_KEY",
                                          help="Bearer key for the endpoint"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Replay a trace open-loop against an OpenAI-compatible endpoint and record latencies."""
    from simulator.workloads.client import ReplayError, replay
    from simulator.workloads.synth import PromptSynthesizer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    if prompt not in ("tokens", "text"):
        raise typer.BadParameter("--prompt must be 'tokens' or 'text'")
    if api not in ("completions", "chat"):
        raise typer.BadParameter("--api must be 'completions' or 'chat'")
    rows = _load(trace, limit=limit)
    try:
        synth = PromptSynthesizer(block_tokens=block_tokens, vocab_lo=vocab_lo, vocab_hi=vocab_hi, seed=seed)
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None

    bar = Progress(TextColumn("[bold]replay[/bold]"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=err, disable=not progress)
    counts = {"ok": 0, "error": 0, "timeout": 0, "cancelled": 0}

    with bar:
        task = bar.add_task("replay", total=len(rows), status="")

        def on_result(r) -> None:  # noqa: ANN001
            counts[r.status] += 1
            bar.update(task, advance=1, status=" ".join(f"{k} {v}" for k, v in counts.items() if v))

        async def run():
            # first Ctrl-C: stop sending, cancel what is in flight, keep the partial result;
            # a second one aborts
            stop = asyncio.Event()
            main = asyncio.current_task()
            loop = asyncio.get_running_loop()

            def on_signal() -> None:
                if stop.is_set():
                    main.cancel()
                stop.set()
                err.print("[yellow]stopping: cancelling requests in flight (Ctrl-C again to abort)[/yellow]")

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, on_signal)
            return await replay(rows, url, model=model, time_scale=time_scale, concurrency=concurrency,
                                prompt_mode=prompt, api=api, timeout_s=timeout_s, ignore_eos=ignore_eos,
                                api_key=api_key, synthesizer=synth, on_result=on_result, stop=stop)

        try:
            result = asyncio.run(run())
        except asyncio.CancelledError:
            raise typer.Exit(130) from None
        except ReplayError as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(1) from None
    result.meta["trace"] = str(trace)
    result.write(out)
    console.print(summary_table(result.summary, title=f"replay of {trace.name} against {url}"))
    console.print(f"results written to {out}" + (" (stopped early: partial)" if result.meta.get("stopped") else ""))
    if result.meta.get("stopped"):
        raise typer.Exit(130)
    if result.summary.ok == 0 and result.summary.requests:
        raise typer.Exit(1)


def gen_workload(
    kind: str = typer.Option("chat", "--kind", "-k", help=f"one of: {', '.join(KINDS)}"),
    n: int = typer.Option(1000, "--n", help="number of requests"),
    seed: int = typer.Option(0, "--seed"),
    rate: float = typer.Option(4.0, "--rate", help="mean arrival rate, requests/s"),
    block_tokens: int = typer.Option(512, "--block-tokens", help="tokens per hash id"),
    out: Path = typer.Option(..., "--out", "-o", help="output trace file (.jsonl, .gz for gzip)"),
) -> None:
    """Write a seeded synthetic workload in the Mooncake trace format."""
    try:
        rows = generate(kind, WorkloadParams(n=n, seed=seed, rate_rps=rate, block_tokens=block_tokens))
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    write_trace(out, rows)
    stats = trace_stats(rows, block_tokens)
    console.print(f"wrote {len(rows)} {kind} requests to {out}")
    console.print_json(json.dumps(stats))


def trace_stats_cmd(
    trace: Path = typer.Argument(..., help="Mooncake-format trace"),
    block_tokens: int = typer.Option(512, "--block-tokens"),
    check_blocks: bool = typer.Option(False, "--check-blocks", help="require ceil(input_length/block) hash ids"),
) -> None:
    """Validate a trace and print its shape (rate, lengths, ideal prefix hit rate)."""
    rows = _load(trace, block_tokens=block_tokens if check_blocks else None)
    console.print_json(json.dumps(trace_stats(rows, block_tokens)))


def register(app: typer.Typer) -> None:
    app.command("replay-trace")(replay_trace)
    app.command("gen-workload")(gen_workload)
    app.command("trace-stats")(trace_stats_cmd)
