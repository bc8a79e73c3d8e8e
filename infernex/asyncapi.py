"""The AsyncAPI document of InferNex's subjects, generated with FastStream from the code.

Every channel of :data:`schemas.registry.CHANNELS` becomes a publisher with its payload
model, so the document cannot say anything the contract does not. ``docs/asyncapi.json``
is the committed copy; ``tests/test_asyncapi.py`` fails when it drifts.
"""

from __future__ import annotations

import json
from pathlib import Path

import infernex
from schemas.registry import CHANNELS

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "asyncapi.json"


def build_document() -> dict:
    from faststream.nats import NatsBroker
    from faststream.specification import AsyncAPI

    broker = NatsBroker("nats://localhost:4222", logger=None)
    for kind, (model, template, description) in CHANNELS.items():
        broker.publisher(
            template,
            title=f"{template}:Publish",
            description=f"{description}. Subject template `{template}`; parameters are escaped tokens "
            f"(characters outside [A-Za-z0-9_-] as %HH).",
            schema=model,
        )
    spec = AsyncAPI(
        broker,
        title="InferNex event bus",
        version=infernex.__version__,
        description="Subjects and payloads of the InferNex control plane on NATS JetStream.",
        schema_version="3.0.0",
    ).to_specification()
    return json.loads(spec.to_json())


def render() -> str:
    return json.dumps(build_document(), indent=2, sort_keys=True) + "\n"


def write(path: Path = DOC_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    return path
