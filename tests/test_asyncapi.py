"""docs/asyncapi.json is generated from the code; it must not drift."""

from infernex.asyncapi import DOC_PATH, build_document, render
from schemas.registry import CHANNELS


def test_document_matches_code():
    assert DOC_PATH.read_text() == render(), (
        "docs/asyncapi.json is stale: regenerate with `python -c 'from infernex.asyncapi import write; write()'`"
    )


def test_every_channel_and_payload_is_documented():
    doc = build_document()
    addresses = {c["address"] for c in doc["channels"].values()}
    assert addresses == {template for _, template, _ in CHANNELS.values()}
    schemas = doc["components"]["schemas"]
    for model, _, _ in CHANNELS.values():
        assert model.__name__ in schemas
        assert "schema_version" in schemas[model.__name__]["properties"]
