"""Tokenization parity with vLLM's OpenAI server (issue 15, item 6).

The fixtures in tests/fixtures/tokenize/ were made by ``make_fixtures.py`` there: a small Hugging
Face tokenizer whose post-processor adds BOS, a chat template that needs transformers' jinja
settings, and the ids Hugging Face ``transformers`` itself produces for each request the way
vLLM calls it (completions: special tokens added; chat: template rendered, no special tokens
added again). The router, the indexer and the simulated engine must all give those ids, and the
engine must cache exactly the blocks the router keys.
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

import httpx
import jinja2
import pytest

from router.tokenize import PromptEncoder, find_model_tokenizer
from simulator.hashing import BlockHasher
from simulator.tokenizer import (
    HFTokenizer,
    RenderedChat,
    SimpleTokenizer,
    render_chat,
    request_to_ids,
    simple_chat_template,
)

FIX = Path(__file__).parent / "fixtures" / "tokenize"
EXPECTED = json.loads((FIX / "expected.json").read_text(encoding="utf-8"))["cases"]
BOS = 1


@pytest.fixture(scope="module")
def hf():
    return HFTokenizer(FIX)


@pytest.mark.parametrize("case", EXPECTED, ids=[c["name"] for c in EXPECTED])
def test_ids_equal_what_transformers_gives_vllm(hf, case):
    assert request_to_ids(hf, case["kind"], case["body"]) == case["ids"]
    if case["kind"] == "chat":
        assert render_chat(hf, case["body"]) == case["rendered"]
    # the router goes through the same function, whatever spec names the tokenizer
    enc = PromptEncoder(str(FIX / "tokenizer.json"))
    assert enc.encode(case["kind"], {"model": "any", **case["body"]}) == case["ids"]


def test_bos_once_completions_add_it_chat_templates_write_it(hf):
    by = {c["name"]: c for c in EXPECTED}
    assert by["completion_text"]["ids"][0] == BOS and by["completion_text"]["ids"].count(BOS) == 1
    assert BOS not in by["completion_no_specials"]["ids"]
    chat = by["chat_system_multi_turn"]["ids"]
    assert chat[0] == BOS and chat.count(BOS) == 1  # the template's {{ bos_token }}, not added again
    assert by["chat_add_special_tokens"]["ids"][:2] == [BOS, BOS]  # only when the client asks for it
    # the fixture really depends on transformers' jinja settings: default jinja renders otherwise
    case = by["chat_system_multi_turn"]
    tmpl = json.loads((FIX / "tokenizer_config.json").read_text())["chat_template"]
    plain = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).from_string(
        tmpl.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    assert plain.render(messages=case["body"]["messages"], bos_token="<s>", add_generation_prompt=True) \
        != case["rendered"]


def test_chat_errors_are_value_errors(hf):
    with pytest.raises(ValueError, match="alternate"):  # the template's raise_exception
        request_to_ids(hf, "chat", {"messages": [{"role": "narrator", "content": "x"}]})
    with pytest.raises(ValueError, match="both"):
        request_to_ids(hf, "chat", {"messages": [{"role": "user", "content": "x"}],
                                    "continue_final_message": True})
    with pytest.raises(ValueError, match="only text content parts"):
        request_to_ids(hf, "chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    with pytest.raises(ValueError, match="boolean"):
        request_to_ids(hf, "completions", {"prompt": "x", "add_special_tokens": "yes"})
    assert PromptEncoder(str(FIX)).encode("chat", {"model": "m", "messages": []}) is None  # routed blind


def test_indexer_style_calls_do_not_add_bos_twice(hf):
    """The indexer calls ``encode(apply_chat_template(messages))``: the rendered chat is marked,
    so the ids are the chat ids, while a plain prompt gets its BOS like a completion."""
    case = next(c for c in EXPECTED if c["name"] == "chat_system_multi_turn")
    text = hf.apply_chat_template(case["body"]["messages"])
    assert isinstance(text, RenderedChat)
    assert hf.encode(text) == case["ids"]
    comp = next(c for c in EXPECTED if c["name"] == "completion_text")
    assert hf.encode(comp["body"]["prompt"]) == comp["ids"]


def test_auto_finds_the_models_tokenizer_or_says_once_it_uses_the_toy_one(tmp_path, monkeypatch, caplog):
    hub = tmp_path / "hub"
    snap = hub / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_bytes((FIX / "tokenizer.json").read_bytes())
    (hub / "models--acme--tiny" / "refs").mkdir()
    (hub / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert find_model_tokenizer("acme/tiny") == snap / "tokenizer.json"
    assert find_model_tokenizer(str(FIX)) == FIX / "tokenizer.json"  # `vllm serve /path/to/model`
    assert find_model_tokenizer("acme/absent") is None
    for odd in ("x" * 5000, "a\x00b", "~no-such-user-here/m"):  # no 500 for names no file system takes
        assert find_model_tokenizer(odd) is None
    enc = PromptEncoder("auto")
    assert isinstance(enc.tokenizer_for("acme/tiny"), HFTokenizer)
    assert enc.encode("completions", {"model": "acme/tiny", "prompt": "hello"})[0] == BOS
    with caplog.at_level(logging.WARNING, logger="router.tokenize"):
        for _ in range(3):
            assert enc.encode("completions", {"model": "toy", "prompt": "a b"}) == SimpleTokenizer().encode("a b")
    assert sum("SimpleTokenizer" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr("router.tokenize.MAX_MODELS", 3)  # bounded: unknown names share one toy tokenizer
    for i in range(10):
        assert enc.encode("completions", {"model": f"typo-{i}", "prompt": "a b"}) == SimpleTokenizer().encode("a b")
    assert len(enc._per_model) == 3


def test_simple_tokenizer_memo_is_exact_and_prefix_sharing():
    rnd = random.Random(7)
    words = ["alpha", "Beta", "ga-mma", "δέλτα", "x1", "!!", "kada", "\n", "\t", "  ", ",", "end."]
    ref_re = re.compile(r"\w+|[^\w\s]")
    tok = SimpleTokenizer()
    fresh = SimpleTokenizer(memo_pieces=4)  # tiny memo: cleared often, same answers
    for n in (0, 3, 200, 2000, 9000):
        text = "".join(rnd.choice(words) + rnd.choice([" ", "", "\n", "  "]) for _ in range(n))
        want = [fresh.token_for_word(w) for w in ref_re.findall(text)]
        assert tok.encode(text) == want
        assert fresh.encode(text) == want
        assert tok.encode(text) == want  # memoized pieces give the same ids again
        assert tok.encode(text + " tail words") == want + tok.encode("tail words")
    msgs = [{"role": "user", "content": "hello"}]
    assert simple_chat_template(msgs, add_generation_prompt=False) == "<|user|>\nhello\n"


@pytest.fixture(scope="module")
def engine():
    from simulator.cluster import EngineSpec, SimCluster
    from simulator.config import EngineConfig

    # the served model name is the tokenizer's folder, as with `vllm serve /models/x`: the router's
    # 'auto' tokenizer must find the same tokenizer.json the engine uses
    cfg = EngineConfig(served_model_name=str(FIX), num_gpu_blocks=512, block_size=4, tokenizer=str(FIX))
    c = SimCluster([EngineSpec(cfg)], time_scale=20).start()
    yield c[0]
    c.stop()


@pytest.mark.parametrize("kind,body", [
    ("completions", {"prompt": "Paris is the capital of France; Berlin is the capital of Germany. "
                               "The router sends each request to the engine that already holds its prefix."}),
    ("chat", {"messages": [{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "hello world, how are you today?"},
                           {"role": "assistant", "content": "I am fine, thank you."},
                           {"role": "user", "content": "What is the capital of France?"}]}),
])
def test_router_block_keys_equal_the_engines(engine, kind, body):
    body = {"model": str(FIX), "max_tokens": 2, **body}
    ids = PromptEncoder("auto").encode(kind, body)
    assert ids is not None and ids[0] == BOS and ids.count(BOS) == 1
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    r = httpx.post(engine.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    hasher = BlockHasher(4)
    keys = hasher.external_hashes(ids)
    assert len(keys) >= 4
    cached = engine.cached_block_hashes()
    assert set(keys) <= cached  # every full block the router keys is a block the engine cached
    # what the router computed before (no BOS for completions / BOS added after the template)
    # matches none of the engine's blocks
    wrong = ids[1:] if kind == "completions" else [BOS] + ids
    assert not set(hasher.external_hashes(wrong)) & cached


def test_an_adapter_is_tokenized_with_its_base_models_tokenizer(tmp_path):
    """vLLM tokenizes a LoRA adapter's prompt with the adapter's own tokenizer when it has one,
    else with the base model's: the router too (it once took the toy tokenizer for any adapter
    name, so an adapter's prefixes never matched and its migrated prompts were re-tokenized wrong)."""
    base = str(FIX)
    enc = PromptEncoder("auto")
    body = {"model": "ad1", "prompt": "Paris is the capital of France, and Berlin of Germany."}
    want = HFTokenizer(FIX).encode(body["prompt"])
    assert list(enc.encode("completions", body, base=base)) == want
    assert enc.tokenizer_for("ad1", base) is enc.tokenizer_for(base)  # one tokenizer (and memo) for both
    assert enc.encode_text("ad1", " more words", base) == HFTokenizer(FIX).encode(" more words", add_special_tokens=False)
    # not known as an adapter (yet): the toy tokenizer, and the later lookup with a base is not stuck with it
    assert enc.encode("completions", body) == SimpleTokenizer().encode(body["prompt"])
    assert list(enc.encode("completions", body, base=base)) == want
    # an adapter with its own tokenizer.json (its name a local folder, as a LoRA path): that one
    own = tmp_path / "own-adapter"
    own.mkdir()
    (own / "tokenizer.json").write_bytes((FIX / "tokenizer.json").read_bytes())
    assert enc.tokenizer_for(str(own), base) is not enc.tokenizer_for(base)


async def test_the_router_counts_an_adapters_prompt_with_the_base_tokenizer():
    from router.config import RouterConfig, StaticBackend
    from router.server import RouterService

    cfg = RouterConfig(backends=[StaticBackend(pod="a", url="http://127.0.0.1:9", model=str(FIX), loras=["ad1"])],
                       bus=False, records=False, strategy="kv-aware", tokenizer="auto")
    svc = RouterService(cfg)
    await svc.start("127.0.0.1", 0)
    try:
        prompt = "The router sends each request to the engine that already holds its prefix."
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{svc.url}/v1/router/decide", json={"model": "ad1", "prompt": prompt})
        assert r.status_code == 200, r.text
        assert r.json()["prompt_tokens"] == len(HFTokenizer(FIX).encode(prompt))
        assert r.json()["prompt_tokens"] != len(SimpleTokenizer().encode(prompt))
    finally:
        await svc.stop()


def test_a_tokenizer_json_s_own_truncation_and_padding_do_not_apply(tmp_path):
    """transformers turns the backend tokenizer's truncation and padding off for a call that asks
    for neither, as vLLM's prompt tokenization does: a long prompt keeps every id, a short one gets
    no padding (checked by hand with transformers 5.24.0: AutoTokenizer on this tokenizer.json with
    truncation at 8 and padding to 64 gives the 16 ids of the plain fixture, and [1, 76, 77] for "hi")."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(FIX / "tokenizer.json"))
    tok.enable_truncation(max_length=8)
    tok.enable_padding(length=64, pad_id=0)
    tok.save(str(tmp_path / "tokenizer.json"))
    text = "Paris is the capital of France, and Berlin is the capital of Germany."
    want = HFTokenizer(FIX).encode(text)
    assert len(want) > 8
    assert HFTokenizer(tmp_path).encode(text) == want
    assert HFTokenizer(tmp_path).encode("hi") == HFTokenizer(FIX).encode("hi")


def test_model_names_sharing_a_tokenizer_file_share_one_tokenizer(tmp_path):
    """`vllm serve /models/x` and a symlink to it, or two names of one folder: one tokenizer and one
    piece memo, not one per name."""
    link = tmp_path / "alias"
    link.symlink_to(FIX, target_is_directory=True)
    enc = PromptEncoder("auto")
    a, b = enc.tokenizer_for(str(FIX)), enc.tokenizer_for(str(link))
    assert isinstance(a, HFTokenizer) and a is b
    assert enc.tokenizer_for(str(FIX / "tokenizer.json")) is a
