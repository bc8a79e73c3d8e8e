"""``infernex export kafka``."""

from __future__ import annotations

import asyncio
import signal

import typer
from rich.console import Console

export_app = typer.Typer(help="Mirror JetStream subjects to external systems.", no_args_is_help=True)
console = Console(stderr=True)


@export_app.command("kafka")
def kafka(
    ctx: typer.Context,
    bootstrap: str = typer.Option(..., "--bootstrap", help="Kafka bootstrap HOST:PORT"),
    subjects: list[str] = typer.Option(["kv.events.>"], "--subjects", "-s", help="subjects to mirror (repeat)"),
    durable: str = typer.Option("kafka-export", "--durable", help="durable consumer name (resume point)"),
    topic_prefix: str = typer.Option("infernex", "--topic-prefix"),
    value_format: str = typer.Option("raw", "--format", help="raw (original bytes) or envelope (JSON)"),
) -> None:
    """Mirror subjects to Kafka topics, at least once, resuming after a restart."""
    from consumers.kafka_export import KafkaExportConfig, KafkaExporter
    from infernex.cli import settings_of

    settings = settings_of(ctx)
    exporter = KafkaExporter(KafkaExportConfig(bootstrap=bootstrap, subjects=tuple(subjects), durable=durable,
                                               topic_prefix=topic_prefix, value_format=value_format),
                             settings.nats)

    async def go():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, exporter.stop)
        console.print(f"exporting {', '.join(subjects)} to Kafka at {bootstrap} (at-least-once delivery)")
        await exporter.run()

    asyncio.run(go())


def register(app: typer.Typer) -> None:
    app.add_typer(export_app, name="export")
