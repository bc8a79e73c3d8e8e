"""A bridge asks JetStream for the last batch it stored before numbering new ones; while the stream
does not answer (a replicated stream electing its leader, a server restarting) it asks again,
within a bound, instead of dying or starting its numbering afresh. On real servers,
tests/test_chaos_cluster.py takes a 3-node cluster down and up under it; here the client's errors
are raised by a stand-in, to pin down each kind of error and the bound."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest

from consumers.kv_bridge import last_stored_position
from schemas import kv_binary
from schemas.kv import BlockStored, KvEventBatch


class _Msg:
    def __init__(self, data: bytes):
        self.data = data


class _Js:
    """get_last_msg raises each of ``errors`` in turn, then returns ``msg`` (or raises NotFound)."""

    def __init__(self, errors: list[Exception], msg: _Msg | None):
        self.errors, self.msg, self.calls = list(errors), msg, 0

    async def get_last_msg(self, stream: str, subject: str):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        if self.msg is None:
            raise nats.js.errors.NotFoundError()
        return self.msg


def _stored(epoch: int, seq: int) -> _Msg:
    b = KvEventBatch(pod="p", model="m", epoch=epoch, seq=seq, ts=1.0,
                     events=[BlockStored(block_hashes=[1], token_ids=[1, 2], block_size=2)])
    return _Msg(kv_binary.encode(b))


def test_an_unanswered_stream_is_asked_again_until_it_answers(caplog):
    js = _Js([nats.errors.TimeoutError(), nats.js.errors.ServiceUnavailableError(), nats.errors.NoRespondersError()],
             _stored(3, 7))
    with caplog.at_level(logging.WARNING, logger="consumers.bus"):
        pos = asyncio.run(last_stored_position(js, "KV", "kv.events.m.p", wait_s=30))
    assert pos == (3, 7) and js.calls == 4
    assert sum("did not answer" in r.getMessage() for r in caplog.records) == 3


def test_an_empty_stream_is_a_fresh_start_and_a_stream_that_never_answers_is_an_error():
    assert asyncio.run(last_stored_position(_Js([], None), "KV", "kv.events.m.p", wait_s=30)) is None
    js = _Js([nats.errors.TimeoutError()] * 100, None)
    with pytest.raises(nats.errors.TimeoutError):
        asyncio.run(last_stored_position(js, "KV", "kv.events.m.p", wait_s=0.5))
    assert js.calls == 2  # asked again within the bound (after 0.25 s; the next wait, 0.5 s, would pass it)
