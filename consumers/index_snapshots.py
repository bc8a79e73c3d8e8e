"""Index snapshots in a JetStream object store: encode in a forked child, read with direct gets.

A snapshot is the index's dump (see :mod:`consumers.index_codec`) with the KV stream sequence
it covers; a reader applies it and goes on from the next sequence.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import io
import logging
import os
import signal
from collections.abc import Awaitable

from nats.js.errors import NotFoundError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from consumers.index_codec import decode_snapshot, encode_snapshot
from schemas import KvEventBatch
from streams.kv_index import KvIndex

log = logging.getLogger(__name__)


def _forked_encode(index: KvIndex, seq: int, created: float) -> Awaitable[bytes]:
    """Fork now; the child encodes ``index`` (as of the fork) and writes it to a pipe. Returns
    an awaitable of the bytes (raises if the child fails). The child runs only the pure dump
    and encoding -- no event loop, locks, sockets or logging -- and always ends in ``os._exit``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            try:  # a signal here must not reach the parent's event loop (shared wakeup fd)
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
            except ValueError:  # forked from a thread other than the main one: nothing was set
                pass
            os.close(r)
            data = encode_snapshot(index, seq, created)
            with os.fdopen(w, "wb") as out:
                out.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(w)

    def collect() -> bytes:
        with os.fdopen(r, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(pid, 0)
        if status != 0 or not data:
            raise RuntimeError(f"the snapshot child process failed (wait status {status})")
        return data

    return asyncio.to_thread(collect)


def snapshot_bucket_name(prefix: str | None, bucket: str) -> str:
    """The object-store bucket of index snapshots under a subject prefix (bucket names have no dots)."""
    return f"{prefix.replace('.', '_')}_{bucket}" if prefix else bucket


async def fetch_snapshot_bytes(js, obj, bucket: str, name: str) -> bytes | None:  # noqa: ANN001
    """A snapshot object's bytes (None when deleted or empty), digest-checked.

    Chunks are read with direct gets, one request each: nats-py's ``ObjectStore.get`` reads
    through an ordered push consumer whose flow-control replies wait for a 0.25 s poll
    (about 1 s for 30 MB) and, without ``writeinto``, grows one bytes object chunk by chunk.
    Buckets without direct gets fall back to ``get(writeinto=...)``.
    """
    info = await obj.get_info(name)
    if info.deleted or not info.size:
        return None
    try:
        stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
        parts = []
        seq = 0
        for _ in range(info.chunks or 0):
            raw = await js.get_msg(stream, seq=seq + 1, subject=subject, direct=True, next=True)
            parts.append(raw.data or b"")
            seq = raw.seq
        data = b"".join(parts)
    except Exception as exc:  # noqa: BLE001 - e.g. a bucket made without allow_direct
        log.info("direct reads of the snapshot failed (%s); reading it through the object store", exc)
        buf = io.BytesIO()
        await obj.get(name, writeinto=buf)
        return buf.getvalue()
    want = info.digest or ""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    if len(data) != info.size or want.split("=", 1)[-1].rstrip("=") != digest.rstrip("="):
        raise ValueError(f"snapshot {bucket}/{name} is incomplete or corrupt "
                         f"({len(data)} of {info.size} bytes, digest mismatch)")
    return data


async def read_snapshot(js, bucket: str, name: str) -> tuple[int, float, list[KvEventBatch]] | None:  # noqa: ANN001
    """The newest index snapshot an indexer wrote, as ``(stream sequence, created, batches)``;
    None when there is none. Other services (router replicas) start from it instead of
    replaying the whole KV stream: apply the batches, then read from ``sequence + 1``."""
    try:
        obj = await js.object_store(bucket)
        data = await fetch_snapshot_bytes(js, obj, bucket, name)
    except NotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - the object store says "not found" in several ways
        if "not found" in str(exc).lower():
            return None
        raise
    if not data:
        return None
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        return decode_snapshot(data)
    finally:
        if gc_was_on:
            gc.enable()

