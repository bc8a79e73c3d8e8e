"""Long prompts are tokenized on the router's tokenizer threads when the tokenizer releases the GIL
(a tokenizer.json), so the event loop serves other requests meanwhile; the ids are the same as on
the loop; the toy tokenizer and short bodies stay on the loop; the piece memo is thread-safe."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from router.config import RouterConfig, StaticBackend
from router.server import RouterService
from router.testing import FakeEngine
from simulator.tokenizer import HFTokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "tokenize"
WORDS = ["cache", "router", "prefill", "decode", "engine", "block", "token", "the", "a", "x42", "2026"]


def text(rnd: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rnd.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


async def _cluster(**kw) -> tuple[list[FakeEngine], RouterService]:
    engines = [FakeEngine("a"), FakeEngine("b")]
    for e in engines:
        await e.start()
    cfg = RouterConfig(backends=[StaticBackend(pod=e.pod, url=e.url, model=e.model) for e in engines], bus=False,
                       records=False, seed=1, strategy="kv-aware", **kw)
    svc = RouterService(cfg)
    await svc.start("127.0.0.1", 0)
    return engines, svc


def _spy(svc: RouterService, slow_s: float) -> list[tuple[str, int, object]]:
    """Record where each prompt is tokenized (thread name, prompt length, ids); a long prompt's
    tokenizing also sleeps ``slow_s`` (without the GIL, as the tokenizer's own encoder does)."""
    calls: list[tuple[str, int, object]] = []
    real = svc.encoder.encode_with

    def encode_with(tok, kind, body, as_array=True):
        n = len(body.get("prompt", ""))
        if n > 4096:
            time.sleep(slow_s)
        ids = real(tok, kind, body, as_array=as_array)
        calls.append((threading.current_thread().name, n, ids))
        return ids

    svc.encoder.encode_with = encode_with
    return calls


async def _long_then_short(svc: RouterService, long_prompt: str) -> list[str]:
    """A long-prompt request, and 50 ms later a short one: the order they finish in."""
    done: list[str] = []

    async def send(session, name, prompt, delay):
        await asyncio.sleep(delay)
        async with session.post(svc.url + "/v1/completions",
                                json={"model": "m", "prompt": prompt, "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()
            await r.read()
        done.append(name)

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(send(s, "long", long_prompt, 0.0), send(s, "short", "a short question", 0.05))
    return done


@pytest.mark.parametrize("threads", [2, 0])
async def test_a_long_prompt_is_tokenized_off_the_loop_and_others_are_served_meanwhile(threads):
    engines, svc = await _cluster(tokenizer=str(FIXTURE), tokenize_threads=threads, tokenize_offload_bytes=4096)
    try:
        calls = _spy(svc, slow_s=0.6)
        long_prompt = text(random.Random(1), 6000)
        order = await _long_then_short(svc, long_prompt)
        where = {n > 4096: name for name, n, _ in calls}  # long prompt? -> the thread it was tokenized on
        main = threading.main_thread().name
        assert where[False] == main  # the short body: on the loop
        if threads:
            assert order == ["short", "long"]  # the loop served the short request meanwhile
            assert where[True].startswith("router-tokenize")
            long_ids = next(ids for _, n, ids in calls if n > 4096)
            assert list(long_ids) == HFTokenizer(FIXTURE).encode(long_prompt)  # the ids the loop would get
        else:
            assert order == ["long", "short"]  # the loop was busy tokenizing
            assert where[True] == main
    finally:
        await svc.stop()
        for e in engines:
            await e.stop()


async def test_the_toy_tokenizer_and_short_bodies_stay_on_the_loop():
    engines, svc = await _cluster(tokenizer="simple", tokenize_threads=2, tokenize_offload_bytes=4096)
    try:
        calls = _spy(svc, slow_s=0.0)
        long_prompt = text(random.Random(2), 6000)
        await _long_then_short(svc, long_prompt)
        assert svc._tok_pool is None  # no thread was started for the toy tokenizer (it holds the GIL)
        assert sorted(n for _, n, _ in calls) == [len("a short question"), len(long_prompt)]
        assert {name for name, _, _ in calls} == {threading.main_thread().name}
    finally:
        await svc.stop()
        for e in engines:
            await e.stop()


def test_the_piece_memo_is_thread_safe():
    """Threads tokenizing prompts that share prefixes at once get the whole texts' ids, and the
    memo's size count equals the pieces it holds."""
    tok = HFTokenizer(FIXTURE)
    assert tok.pieces is not None
    tok.pieces.max_chars = 40_000  # small: evictions happen while threads read and write
    rnd = random.Random(3)
    docs = [text(rnd, 3000) for _ in range(4)]
    prompts = [rnd.choice(docs) + " question " + text(rnd, rnd.randint(50, 2000)) for _ in range(120)]
    want = [tok._encode_whole(p, True) for p in prompts]
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda p: tok.encode_array(p, True).tolist(), prompts))
    assert got == want
    memo = tok.pieces
    assert memo._chars == sum(n for _, n in memo._held.values())
    assert memo._chars <= memo.max_chars
    assert memo.hits > 0


async def test_a_long_list_of_token_ids_is_not_handed_over():
    """A prompt given as token ids needs no tokenizer: it stays on the loop whatever its size."""
    engines, svc = await _cluster(tokenizer=str(FIXTURE), tokenize_threads=2, tokenize_offload_bytes=4096)
    try:
        calls = _spy(svc, slow_s=0.0)
        ids = list(range(5, 305)) * 10  # 3,000 ids: a body of about 12 KB
        async with aiohttp.ClientSession() as s:
            async with s.post(svc.url + "/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
        assert [name for name, _, _ in calls] == [threading.main_thread().name]
        assert list(calls[0][2]) == ids
        assert svc._tok_pool is None
    finally:
        await svc.stop()
        for e in engines:
            await e.stop()
