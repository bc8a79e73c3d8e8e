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
    return _add_kv_binary(json.loads(spec.to_json()))


def _add_kv_binary(doc: dict) -> dict:
    """``kv.events`` carries the batch as JSON or in the binary encoding of
    :mod:`schemas.kv_binary`: the channel lists both messages, each with its content type and
    the headers the bridge sets."""
    from schemas import kv_binary

    template = CHANNELS["kv.events"][1]
    ch_name = f"{template}:Publish"
    channel = doc["channels"][ch_name]
    json_name = f"{ch_name}:Message"
    bin_name = f"{ch_name}:BinaryMessage"
    esc = ch_name.replace("{", "%7B").replace("}", "%7D")
    doc["components"]["messages"][json_name]["contentType"] = kv_binary.JSON_CONTENT_TYPE
    doc["components"]["messages"][bin_name] = {
        "title": bin_name,
        "contentType": kv_binary.CONTENT_TYPE,
        "headers": kv_binary.HEADERS_SCHEMA,
        "payload": {"oneOf": [{"$ref": "#/components/schemas/KvEventBatchBinary"},
                              {"$ref": "#/components/schemas/KvEventBatchGroupBinary"}]},
    }
    doc["components"]["schemas"]["KvEventBatchBinary"] = kv_binary.PAYLOAD_SCHEMA
    doc["components"]["schemas"]["KvEventBatchGroupBinary"] = kv_binary.GROUP_SCHEMA
    channel["messages"]["BinaryMessage"] = {"$ref": f"#/components/messages/{bin_name.replace('{', '%7B').replace('}', '%7D')}"}
    channel["description"] += (f". Payload: the KvEventBatch JSON ({kv_binary.JSON_CONTENT_TYPE}) or its binary "
                               f"encoding ({kv_binary.CONTENT_TYPE}, schemas/kv_binary.py); consumers accept both")
    doc["operations"][ch_name]["messages"].append({"$ref": f"#/channels/{esc}/messages/BinaryMessage"})
    return doc


def render() -> str:
    return json.dumps(build_document(), indent=2, sort_keys=True) + "\n"


def write(path: Path = DOC_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    return path
