"""Shared fixtures: a real nats-server with JetStream per test session, and per-test
subject prefixes and streams so tests never see each other's messages."""

from __future__ import annotations

import uuid

import pytest

from infernex.embedded_nats import EmbeddedNats, NatsBinaryMissing
from schemas.config import NatsConfig


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    """A real ``nats-server -js`` on a free port with a temporary store."""
    try:
        server = EmbeddedNats(tmp_path_factory.mktemp("nats-store"))
    except NatsBinaryMissing as exc:  # fail fast with the reason
        pytest.fail(str(exc))
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def prefix() -> str:
    """A unique subject root for this test (streams are created under it)."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def nats_config(nats_server, prefix) -> NatsConfig:
    return NatsConfig(servers=[nats_server.url], subject_prefix=prefix, connect_timeout_s=3)


@pytest.fixture
async def nc(nats_config):
    from consumers import bus

    client = await bus.connect(nats_config)
    yield client
    await client.close()


@pytest.fixture
async def topology(nc, prefix):
    """The full topology applied under this test's prefix; returns the specs."""
    from consumers import bus
    from streams.topology import build_topology

    specs = build_topology(prefix=prefix)
    await bus.apply_topology(nc.jetstream(), specs)
    yield specs
    js = nc.jetstream()
    for spec in specs:
        try:
            await js.delete_stream(spec.name)
        except Exception:  # noqa: BLE001 - stream may be gone already
            pass


def pytest_sessionstart(session):
    """Compile the KV index's and the bridge's kernels once, up front (numba caches them on disk
    for every later process): else the first tests and the services they start would each pay the
    compile (the bridge's transcoder alone takes 30-40 s cold on a busy 2-core machine, longer than
    a bridge test's bound)."""
    from consumers import kv_transcode, kv_wire_compiled
    from streams.kv_index import warm_up

    warm_up()
    kv_wire_compiled.warm_up()
    kv_transcode.warm_up()
