"""The simulator serves vLLM's /tokenize, /detokenize and 0.33's /v1/completions/render, and
their tokens are the ones the engine caches (so a router keying requests through them agrees
with the engine's KV events)."""

from __future__ import annotations

import httpx
import pytest

from simulator.cluster import EngineSpec, SimCluster
from simulator.config import EngineConfig
from simulator.hashing import to_external

MODEL = "sim-render"


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(served_model_name=MODEL, num_gpu_blocks=512, block_size=16)
    c = SimCluster([EngineSpec(cfg)], time_scale=20).start()
    yield c[0]
    c.stop()


def test_tokenize_detokenize_and_render_agree_with_the_engine_cache(engine):
    url = engine.url
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    tok = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True},
                     timeout=30).json()
    ids = tok["tokens"]
    assert tok["count"] == len(ids) > 32 and tok["max_model_len"] == engine.engine.config.max_model_len
    assert len(tok["token_strs"]) == len(ids)
    text = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text == engine.call(lambda e: e.tokenizer.decode(ids))  # the simple tokenizer is not invertible
    assert httpx.post(url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"] == ids

    rendered = httpx.post(url + "/v1/completions/render", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                                "cache_salt": "t1"}, timeout=30).json()
    assert isinstance(rendered, list) and len(rendered) == 1
    r = rendered[0]
    assert r["token_ids"] == ids and r["request_id"].startswith("cmpl-")
    assert r["sampling_params"]["max_tokens"] == 3 and r["cache_salt"] == "t1" and r["model"] == MODEL
    two = httpx.post(url + "/v1/completions/render", json={"prompt": [prompt, "hello there"]}, timeout=30).json()
    assert [x["request_id"][-2:] for x in two] == ["-0", "-1"] and two[0]["token_ids"] == ids

    # the engine caches exactly the blocks of those tokens
    httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=30)
    cached = engine.cached_block_hashes()
    want = engine.call(lambda e: [to_external(h) for h in e.core.hasher.hash_blocks(ids)])
    assert want and all(h in cached for h in want)

    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30).json()
    assert chat["count"] == len(chat["tokens"]) > 0


@pytest.mark.parametrize("path,body,status", [
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
    ("/tokenize", {"prompt": 5}, 400),
    ("/tokenize", {"messages": None}, 400),
    ("/tokenize", {"messages": []}, 400),
    ("/detokenize", {"tokens": ["a"]}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/v1/completions/render", {"prompt": "x", "use_beam_search": True}, 400),
])
def test_bad_requests_get_openai_errors(engine, path, body, status):
    r = httpx.post(engine.url + path, json=body, timeout=30)
    assert r.status_code == status
    assert r.json()["error"]["message"]
