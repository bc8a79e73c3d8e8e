"""``infernex export kafka``."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Optional

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
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port",
                                               help="serve /metrics, /healthz and /readyz here"),
    security_protocol: str = typer.Option("PLAINTEXT", "--security-protocol",
                                          help="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL"),
    sasl_mechanism: Optional[str] = typer.Option(None, "--sasl-mechanism",
                                                 help="PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512"),
    sasl_username: Optional[str] = typer.Option(None, "--sasl-username"),
    sasl_password_env: str = typer.Option("INFERNEX_KAFKA_PASSWORD", "--sasl-password-env",
                                          help="environment variable holding the SASL password (never a flag: "
                                               "flags show in the process list)"),
    ssl_cafile: Optional[Path] = typer.Option(None, "--ssl-cafile", help="CA bundle to verify the brokers"),
    ssl_certfile: Optional[Path] = typer.Option(None, "--ssl-certfile", help="client certificate (mutual TLS)"),
    ssl_keyfile: Optional[Path] = typer.Option(None, "--ssl-keyfile", help="client key (mutual TLS)"),
) -> None:
    """Mirror subjects to Kafka topics, at least once, resuming after a restart."""
    from prometheus_client import CollectorRegistry

    from consumers.health import Health
    from consumers.kafka_export import KafkaExportConfig, KafkaExporter, KafkaSecurity
    from infernex.cli import settings_of
    from infernex.commands.common import fail, nats_error

    settings = settings_of(ctx)
    for f in (ssl_cafile, ssl_certfile, ssl_keyfile):
        if f is not None and not f.is_file():
            fail(f"cannot read {f}: no such file", code=2)
    try:
        security = KafkaSecurity(protocol=security_protocol.upper(), sasl_mechanism=sasl_mechanism,
                                 username=sasl_username, password=os.environ.get(sasl_password_env),
                                 cafile=str(ssl_cafile) if ssl_cafile else None,
                                 certfile=str(ssl_certfile) if ssl_certfile else None,
                                 keyfile=str(ssl_keyfile) if ssl_keyfile else None)
        registry = CollectorRegistry()
        health = Health("kafka-export", expect=("nats", "consumer_lag", "kafka"))
        exporter = KafkaExporter(KafkaExportConfig(bootstrap=bootstrap, subjects=tuple(subjects), durable=durable,
                                                   topic_prefix=topic_prefix, value_format=value_format,
                                                   security=security),
                                 settings.nats, registry=registry, health=health)
    except ValueError as exc:
        msg = str(exc)
        if "password" in msg:
            msg += f" (set the password in ${sasl_password_env})"
        fail(msg, code=2)

    async def go():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, exporter.stop)
        if metrics_port is not None:
            from consumers.health import serve

            await serve(health, metrics_port, registry=registry)
            console.print(f"metrics and health on http://0.0.0.0:{metrics_port}/metrics, /healthz, /readyz")
        console.print(f"exporting {', '.join(subjects)} to Kafka at {bootstrap} ({security.protocol}, at-least-once)")
        await exporter.run()

    try:
        asyncio.run(go())
    except ConnectionError as exc:
        fail(nats_error(exc))
    except Exception as exc:  # noqa: BLE001 - Kafka unreachable or refused: one line, no secrets in it
        if type(exc).__module__.startswith("aiokafka"):
            fail(f"Kafka at {bootstrap}: {type(exc).__name__}: {exc}"[:300])
        raise


def register(app: typer.Typer) -> None:
    app.add_typer(export_app, name="export")
