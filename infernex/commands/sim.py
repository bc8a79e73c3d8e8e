"""``infernex sim``: run simulated vLLM engines (OpenAI HTTP + /metrics + ZMQ KV events)."""

from __future__ import annotations

import asyncio
import signal
from typing import Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

console = Console()
err = Console(stderr=True)


def sim(
    ctx: typer.Context,
    engines: int = typer.Option(1, "--engines", "-n", min=1, help="number of engines in this process"),
    base_port: Optional[int] = typer.Option(None, "--base-port", help="HTTP port of engine 0 (+i); 0: free ports"),
    host: Optional[str] = typer.Option(None, "--host"),
    model: Optional[str] = typer.Option(None, "--model", help="served model name"),
    model_profile: Optional[str] = typer.Option(None, "--model-profile", help="size preset, e.g. llama-3.1-8b"),
    profile: Optional[str] = typer.Option(None, "--profile", help="hardware: h100, a100, ascend-910b3, ascend-910b4"),
    tp: Optional[int] = typer.Option(None, "--tp", help="tensor-parallel size (devices per engine)"),
    block_size: Optional[int] = typer.Option(None, "--block-size"),
    num_gpu_blocks: Optional[int] = typer.Option(None, "--num-gpu-blocks", help="default: from HBM size"),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs"),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="'simple' or a local tokenizer.json path"),
    hash_algo: Optional[str] = typer.Option(None, "--prefix-caching-hash-algo", help="sha256 | sha256_cbor | xxhash | xxhash_cbor"),
    hash_seed: Optional[str] = typer.Option(None, "--hash-seed", help="vLLM's PYTHONHASHSEED value"),
    time_scale: Optional[float] = typer.Option(None, "--time-scale", help="virtual seconds per real second"),
    kv_port_base: Optional[int] = typer.Option(None, "--kv-events-port-base",
                                               help="ZMQ PUB port of engine 0 (+2i, replay = +1); default: free ports"),
    no_kv_events: bool = typer.Option(False, "--no-kv-events", help="do not publish KV events"),
    vllm_format: Optional[str] = typer.Option(None, "--vllm-format",
                                              help="KV-event wire format of vLLM 0.33 (default) | 0.22 | 0.11"),
    array_like_events: bool = typer.Option(False, "--array-like-events",
                                           help="the all-array encoding of the oldest vLLM releases and SGLang"),
    role: str = typer.Option("aggregated", "--role",
                             help="aggregated | prefill | decode | kv_both, or a comma list cycled over engines"),
    engine_prefix: str = typer.Option("engine", "--engine-prefix", help="engine ids are <prefix>-<i>"),
    error_rate: float = typer.Option(0.0, "--error-rate", help="fault: fraction of requests answered 500"),
    slow_factor: float = typer.Option(1.0, "--slow-factor", help="fault: multiply step times"),
    die_after_tokens: Optional[int] = typer.Option(None, "--die-after-tokens", help="fault: cut streams after N"),
    refuse: bool = typer.Option(False, "--refuse-connections", help="fault: start not listening"),
) -> None:
    """Run N simulated vLLM engines until Ctrl-C; prints their URLs and ZMQ endpoints."""
    from infernex.cli import settings_of
    from simulator.cluster import specs_for, start_engines
    from simulator.config import EngineConfig

    s = settings_of(ctx).sim
    base = s.engine.model_dump()
    overrides = {
        "served_model_name": model, "model_profile": model_profile, "hardware": profile,
        "tensor_parallel_size": tp, "block_size": block_size, "num_gpu_blocks": num_gpu_blocks,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": max_model_len, "tokenizer": tokenizer, "prefix_caching_hash_algo": hash_algo,
        "hash_seed": hash_seed, "kv_events_format": vllm_format,
    }
    base.update({k: v for k, v in overrides.items() if v is not None})
    base["engine_id"] = f"{engine_prefix}-0"
    base["emit_kv_events"] = not no_kv_events
    base["faults"] = {"error_rate": error_rate, "slow_factor": slow_factor, "die_after_tokens": die_after_tokens,
                      "refuse_connections": refuse}
    roles = [r.strip() for r in role.split(",") if r.strip()]
    try:
        cfg = EngineConfig.model_validate({**base, "role": roles[0] if roles else "aggregated"})
        specs = specs_for(engines, cfg, base_port=s.base_port if base_port is None else base_port,
                          kv_port_base=s.kv_events_port_base if kv_port_base is None else kv_port_base,
                          host=host or s.host, roles=roles or None)
        for spec in specs:
            spec.config.resolved_num_gpu_blocks()
    except (ValidationError, ValueError) as exc:
        err.print(f"[red]invalid engine settings:[/red] {exc}")
        raise typer.Exit(2) from None
    scale = time_scale if time_scale is not None else s.time_scale
    if scale <= 0:
        err.print("[red]--time-scale must be positive[/red]")
        raise typer.Exit(2)

    async def main() -> None:
        try:
            running = await start_engines(specs, time_scale=scale, kv_array_like=array_like_events)
        except OSError as exc:
            err.print(f"[red]cannot start engines:[/red] {exc}")
            raise typer.Exit(1) from None
        table = Table(title=f"simulated vLLM engines (time x{scale:g})")
        for col in ("engine", "role", "model", "url", "kv events (PUB)", "replay (ROUTER)", "blocks"):
            table.add_column(col, overflow="fold")
        for e in running:
            table.add_row(e.engine_id, e.config.role, e.config.served_model_name, e.url, e.kv_endpoint or "-",
                          e.replay_endpoint or "-", str(e.core.num_blocks))
        Console(width=max(console.width, 160)).print(table)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        for e in running:
            await e.stop()

    asyncio.run(main())


def register(app: typer.Typer) -> None:
    app.command("sim")(sim)
