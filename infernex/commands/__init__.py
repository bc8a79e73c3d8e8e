"""Command modules of the ``infernex`` CLI, loaded lazily.

Each module defines ``register(app: typer.Typer)``. ``COMMANDS`` names every top-level
command, the module that registers it and its one-line help, so ``infernex --help`` lists
them without importing any module. A command missing here still runs (the CLI falls back
to importing every module), but ``tests/test_cli_lazy.py`` fails until its line is added.
"""

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module under infernex.commands, one-line help of at most ~60 characters)
    "up": ("backbone", "Start embedded NATS with the streams applied (local)."),
    "status": ("status", "One view: NATS, streams, lag, dead letters, router, index."),
    "streams": ("backbone", "JetStream topology: apply and inspect the streams."),
    "pub": ("backbone", "Validate a JSON event and publish it."),
    "tail": ("backbone", "Follow subjects and print events readably."),
    "demo": ("demo", "Run the whole system locally and compare strategies."),
    "sim": ("sim", "Run simulated vLLM engines until Ctrl-C."),
    "sim-devices": ("producers", "Serve simulated NPU/GPU telemetry."),
    "bridge": ("producers", "Bridges from engines onto JetStream."),
    "collect": ("producers", "Collectors: engine metrics and device telemetry."),
    "indexer": ("indexer", "Fold KV events into the global KV-cache index."),
    "router": ("router", "Run hermes-router (OpenAI-compatible HTTP)."),
    "diagnose": ("diagnose", "Device diagnosis: telemetry -> findings."),
    "sla-sink": ("sla", "Consume records, metrics, findings into the SLA store."),
    "sla": ("sla", "SLA history: report, schema migrations, row counts."),
    "planner": ("sla", "Publish replica hints per PD pool from the SLA history."),
    "replay": ("replay", "Replay JetStream history: state, re-decide, incidents."),
    "simulate": ("simulate", "Compare strategies in virtual time (router code)."),
    "replay-trace": ("workloads", "Replay a trace against an OpenAI-compatible endpoint."),
    "gen-workload": ("workloads", "Write a seeded synthetic workload (Mooncake format)."),
    "trace-stats": ("workloads", "Validate a trace and print its shape."),
    "export": ("export", "Mirror JetStream subjects to external systems."),
    "pd-sidecar": ("pd_sidecar", "Decode-side P/D sidecar for EPP mode."),
}
