"""``infernex pd-sidecar``: the decode-side P/D sidecar of EPP mode (router.epp.sidecar)."""

from __future__ import annotations

import asyncio
import signal

import typer
from rich.console import Console

console = Console()


def pd_sidecar_cmd(
    decode: str = typer.Option(..., "--decode", help="base URL of the local decode engine, e.g. http://127.0.0.1:8100"),
    host: str = typer.Option("0.0.0.0", "--host"),
    port: int = typer.Option(8000, "--port", help="the port the InferencePool targets on decode pods"),
) -> None:
    """Run prefill on the pod named in x-prefiller-host-port, then decode on the local engine."""
    from router.epp.sidecar import PdSidecar

    async def serve() -> None:
        side = PdSidecar(decode)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        url = await side.start(host, port)
        console.print(f"pd-sidecar on {url} -> decode {decode}", highlight=False)
        await stop.wait()
        await side.stop()

    asyncio.run(serve())


def register(app: typer.Typer) -> None:
    app.command("pd-sidecar")(pd_sidecar_cmd)
