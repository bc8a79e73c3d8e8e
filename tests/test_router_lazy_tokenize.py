"""A long text prompt is tokenized only as far as an engine may hold it (router/lazy_prompt.py).

Ground truth: engines hold prefixes of documents (their KV events, from the whole text's ids).
For every prompt, each engine's match read with the lazily tokenized ids equals the match read
with the whole prompt's ids, while new text past the matches is not tokenized. Routes of text left
untokenized still count as predicted blocks for a later prompt with the same text."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest

from router.config import RouterConfig, StaticBackend
from router.flow import Flow
from router.server import RouterService
from schemas import BlockStored, KvEventBatch
from simulator.tokenizer import HFTokenizer, SimpleTokenizer
from streams.clock import SystemClock
from streams.kv_index import KvIndex, block_key_array

FIXTURE = Path(__file__).parent / "fixtures" / "tokenize"
WORDS = ["cache", "router", "prefill", "decode", "engine", "block", "token", "the", "a", "x42", "2026", "Paris",
         "summary", "value", "(note)", "alpha", "beta"]
BS = 16


def text(rnd: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rnd.choice(WORDS) if rnd.random() < 0.9 else f"w{rnd.randrange(10**5)}"
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def service(lazy: bool = True, pods=("a", "b", "c", "d"), tokenizer: str = str(FIXTURE)) -> RouterService:
    cfg = RouterConfig(backends=[StaticBackend(pod=p, url=f"http://127.0.0.1:{9 + i}", model="m")
                                 for i, p in enumerate(pods)], bus=False, records=False, seed=1,
                       strategy="kv-aware", tokenizer=tokenizer, tokenize_lazily=lazy)
    return RouterService(cfg, index=KvIndex(SystemClock(), default_block_size=BS))


def hold(index: KvIndex, pod: str, ids: list[int], blocks: int, seq: int = 0) -> None:
    """``pod`` reports storing the first ``blocks`` blocks of ``ids`` (as an engine's KV events)."""
    hashes = [hash((pod, i, tuple(ids[:(i + 1) * BS]))) & (2**63 - 1) or 1 for i in range(blocks)]
    index.apply(KvEventBatch(pod=pod, model="m", seq=seq, ts=time.time(), events=[
        BlockStored(block_hashes=hashes, token_ids=ids[:blocks * BS], block_size=BS)]))


def route(svc: RouterService, prompt: str, i: int):
    body = {"model": "m", "prompt": prompt, "max_tokens": 2}
    rreq = svc._routing_request("completions", body, f"r{i}", len(prompt))
    flow = Flow(rid=f"r{i}", kind="completions", path="/v1/completions", body=body, stream=False,
                 arrival=0.0, t0=0.0, rreq=rreq)
    d = svc._decide(rreq, flow)
    svc._note_route(flow, d)
    return rreq, d


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("which", ["tokenizer.json", "simple"])
def test_each_engines_match_is_the_whole_prompts_and_new_text_is_not_tokenized(seed, which):
    rnd = random.Random(seed)
    tok = HFTokenizer(FIXTURE) if which == "tokenizer.json" else SimpleTokenizer()
    svc = service(tokenizer=str(FIXTURE) if which == "tokenizer.json" else "simple")
    index = svc.index
    scale = 1 if which == "tokenizer.json" else 4  # the toy tokenizer's pieces are 2,048 characters, not 512
    docs = [text(rnd, scale * rnd.choice([1500, 4000, 9000])) for _ in range(3)]
    for j, pod in enumerate(("a", "b", "c")):  # each engine holds a prefix of a document, some all of it
        ids = tok.encode(docs[j % 3] + " " + text(rnd, 300), add_special_tokens=True)
        hold(index, pod, ids, rnd.randint(1, len(ids) // BS))
    lazier = 0
    for i in range(12):
        doc = docs[rnd.randrange(3)]
        prompt = doc[: rnd.randint(len(doc) // 2, len(doc))] + " " + text(rnd, scale * rnd.choice([100, 1500, 3000]))
        rreq = svc._routing_request("completions", {"model": "m", "prompt": prompt}, f"q{i}", len(prompt))
        whole = np.array(tok.encode(prompt, add_special_tokens=True), dtype=np.uint32)
        got = np.asarray(rreq.token_ids)
        assert np.array_equal(got, whole[: len(got)])  # a prefix of the whole prompt's ids
        lazy_m = index.match_counts("m", block_key_array(got, BS))[0]
        full_m = index.match_counts("m", block_key_array(whole, BS))[0]
        assert lazy_m == full_m  # what the router reads: the same for every engine
        lazier += len(got) < len(whole)
        assert abs(rreq.prompt_tokens - len(whole)) <= 0.15 * len(whole)  # the rest estimated
        assert (rreq.piece_tail is None) == (len(got) == len(whole))
    assert lazier >= 6  # most prompts end in text no engine holds: left untokenized


def test_a_burst_sharing_a_new_document_goes_to_one_engine_as_with_whole_prompts():
    """The first request's document is left mostly untokenized; the next ones with the same document
    must still count it as predicted on the first one's engine (as whole-prompt predictions would)."""
    rnd = random.Random(7)
    doc = text(rnd, 8000)
    prompts = [doc + " Question: " + text(rnd, 1500) for _ in range(4)]
    runs = {}
    for lazy in (True, False):
        svc = service(lazy)
        runs[lazy] = [route(svc, p, i) for i, p in enumerate(prompts)]
    lazy_runs, full_runs = runs[True], runs[False]
    first = lazy_runs[0][1].target.pod
    assert len(lazy_runs[0][0].token_ids) < len(full_runs[0][0].token_ids) // 2  # the first: mostly untokenized
    assert [d.target.pod for _, d in lazy_runs] == [d.target.pod for _, d in full_runs] == [first] * 4
    doc_blocks = len(HFTokenizer(FIXTURE).encode(doc, add_special_tokens=True)) // BS
    piece_blocks = 600 // 3 // BS + 1  # about one memo piece (512+ characters) of blocks
    for (_, dl), (_, df) in zip(lazy_runs[1:], full_runs[1:]):
        ol, of = dl.stages[0].overlap.get(first, 0), df.stages[0].overlap.get(first, 0)
        assert of >= doc_blocks - 1
        assert of - piece_blocks <= ol <= of  # the document as predicted, short of at most its last piece


def test_an_engine_that_evicted_routed_text_is_not_predicted_to_hold_it_again(monkeypatch):
    """Ground truth after an eviction: the first request's document went to its engine mostly
    untokenized (a piece route); the engine computed it (its KV events) and, after the request
    ended, evicted all but its first blocks. A later prompt with the same document must read what
    that engine holds now, not the whole document as predicted from the old route."""
    import router.lazy_prompt as lp
    from schemas import BlockRemoved

    monkeypatch.setattr(lp, "SETTLE_S", 0.0)  # (the engine's events are applied here before the route ends)
    rnd = random.Random(11)
    tok = HFTokenizer(FIXTURE)
    doc = text(rnd, 8000)
    p1, p2 = (doc + " Question: " + text(rnd, 1500) for _ in range(2))
    for evict in (False, True):
        svc = service()
        index = svc.index
        body = {"model": "m", "prompt": p1, "max_tokens": 2}
        rreq = svc._routing_request("completions", body, "r1", len(p1))
        flow = Flow(rid="r1", kind="completions", path="/v1/completions", body=body, stream=False,
                    arrival=0.0, t0=0.0, rreq=rreq)
        d = svc._decide(rreq, flow)
        pod = d.target.pod
        svc._note_route(flow, d)
        assert rreq.piece_tail  # the document mostly untokenized: remembered as routed there
        ids = tok.encode(p1, add_special_tokens=True)
        n = len(ids) // BS
        hold(index, pod, ids, n)  # the engine computed the whole prompt
        svc._finish(flow)  # the request is over
        kept = 3
        if evict:
            hashes = [hash((pod, i, tuple(ids[:(i + 1) * BS]))) & (2**63 - 1) or 1 for i in range(kept, n)]
            index.apply(KvEventBatch(pod=pod, model="m", seq=1, ts=time.time(),
                                     events=[BlockRemoved(block_hashes=hashes)]))
        whole = block_key_array(np.array(tok.encode(p2, add_special_tokens=True), dtype=np.uint32), BS)
        truth = index.match_counts("m", whole)[0].get(pod, 0)  # what the engine's events say it holds of p2
        _, d2 = route(svc, p2, 2)
        seen = d2.stages[0].overlap.get(pod, 0)
        if evict:  # exactly what it kept, nothing predicted from the old route
            assert seen == truth == kept and not d2.stages[0].predicted.get(pod)
        else:  # the document it still holds, read up to a memo piece short (as while the route stood)
            doc_blocks = len(tok.encode(doc, add_special_tokens=True)) // BS
            assert truth >= doc_blocks - 1 and truth - (600 // 3 // BS + 1) <= seen <= truth


def test_off_tokenizes_whole_prompts():
    rnd = random.Random(3)
    tok = HFTokenizer(FIXTURE)
    prompt = text(rnd, 6000)
    rreq = service(lazy=False)._routing_request("completions", {"model": "m", "prompt": prompt}, "r", len(prompt))
    assert list(rreq.token_ids) == tok.encode(prompt, add_special_tokens=True) and rreq.piece_tail is None


@pytest.mark.parametrize("seed", range(20))
def test_a_plans_first_pieces_are_the_whole_texts_first_ids(seed):
    """Both tokenizers' plans, with any part of the text in the memo already."""
    rnd = random.Random(seed)
    words = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(800, 5000)))
    for tok, ref in ((HFTokenizer(FIXTURE), HFTokenizer(FIXTURE)), (SimpleTokenizer(), SimpleTokenizer())):
        whole = np.asarray(ref.encode_array(words, add_special_tokens=True))
        tok.encode_array(words[: rnd.randint(0, len(words))], add_special_tokens=True)  # some pieces held
        plan = tok.plan(words, add_special_tokens=True)
        assert plan is not None and plan.lead <= len(plan)
        for k in sorted(rnd.sample(range(1, len(plan) + 1), min(4, len(plan)))):
            ids = plan.ids(k)
            assert np.array_equal(ids, whole[: len(ids)]) and plan.chars(k) <= len(words)
        assert np.array_equal(plan.ids(len(plan)), whole)
        assert np.array_equal(np.asarray(tok.encode_array(words, add_special_tokens=True)), whole)


@pytest.mark.parametrize("seed", range(12))
def test_sub_pieces_give_the_whole_texts_first_ids(seed):
    """``ids_at(k, j)``: the first k pieces and j sub-pieces of the next, any memo state before
    (some pieces and sub-pieces held from an earlier text sharing a prefix), both tokenizers; all
    of a piece's sub-pieces make the piece, which the memo then holds whole."""
    rnd = random.Random(seed)
    for tok, ref, scale in ((HFTokenizer(FIXTURE), HFTokenizer(FIXTURE), 1), (SimpleTokenizer(), SimpleTokenizer(), 4)):
        words = " ".join(rnd.choice(WORDS) for _ in range(scale * rnd.randint(800, 3000)))
        whole = np.asarray(ref.encode_array(words, add_special_tokens=True))
        cut = rnd.randint(0, len(words))
        earlier = tok.plan(words[:cut] + " " + text(rnd, scale * 700), add_special_tokens=True)  # shares a prefix
        if earlier is not None:
            at = rnd.randrange(len(earlier))
            earlier.ids_at(at, rnd.randint(0, earlier.splits(at)))
        plan = tok.plan(words, add_special_tokens=True)
        i = plan.lead if plan.lead < len(plan) else len(plan) - 1
        subs = plan.splits(i)
        assert subs > 1  # (pieces are cut finer)
        for j in sorted(rnd.sample(range(1, subs + 1), min(3, subs))):
            ids = plan.ids_at(i, j)
            assert np.array_equal(ids, whole[: len(ids)]) and plan.chars_at(i, j) <= len(words)
        assert np.array_equal(plan.ids_at(i, subs), whole[: len(plan.ids(i + 1))])
        assert tok.plan(words, add_special_tokens=True).lead >= i + 1  # the piece held whole now
        assert np.array_equal(plan.ids(len(plan)), whole)


def test_a_first_sub_piece_with_special_tokens_is_kept_apart():
    """The text's first sub-piece carries the BOS token when the special tokens are added: the same
    text held without them must not be taken for it (nor the other way round)."""
    words = " ".join(WORDS * 60)
    for first, then in ((False, True), (True, False)):
        tok = HFTokenizer(FIXTURE)
        tok.plan(words, add_special_tokens=first).ids_at(0, 1)
        ids = tok.plan(words, add_special_tokens=then).ids_at(0, 1)
        whole = tok.encode(words, add_special_tokens=then)
        assert ids.tolist() == whole[: len(ids)]


def test_the_first_new_piece_is_encoded_only_where_its_text_is_new():
    """A document held by an engine, then questions after it: the piece that holds the document's
    end and a question's start is encoded sub-piece by sub-piece, so each new question costs the
    encoder a sub-piece or two (not the whole 512-character piece), and the matches stay exact."""
    rnd = random.Random(5)
    tok = HFTokenizer(FIXTURE)
    svc = service()
    router_tok = svc.encoder.tokenizer_for("m", None)
    encoded = []
    inner = router_tok.pieces._encode_batch
    router_tok.pieces._encode_batch = lambda texts, sp: (encoded.extend(texts), inner(texts, sp))[1]
    doc = text(rnd, 6000)
    hold(svc.index, "b", tok.encode(doc, add_special_tokens=True), len(tok.encode(doc)) // BS)
    per_question = []
    for i in range(8):
        prompt = doc + "\n\nQuestion: " + text(rnd, 1200)
        encoded.clear()
        rreq, d = route(svc, prompt, i)
        whole = np.array(tok.encode(prompt, add_special_tokens=True), dtype=np.uint32)
        assert np.array_equal(np.asarray(rreq.token_ids), whole[: len(rreq.token_ids)])
        lazy_m = svc.index.match_counts("m", block_key_array(rreq.token_ids, BS))[0]
        assert lazy_m == svc.index.match_counts("m", block_key_array(whole, BS))[0]
        assert d.target.pod == "b"
        per_question.append(sum(map(len, encoded)))
    # the first prompt is encoded as far as "b" holds it, piece by piece; the second encodes the
    # sub-pieces of the piece where the questions start (held from then on); later ones only theirs
    assert per_question[0] > 6000 and per_question[1] <= 600, per_question
    assert max(per_question[2:]) < 300 and sum(per_question[2:]) / 6 < 220, per_question


def test_text_routed_to_an_engine_that_reported_it_is_not_predicted_again():
    """A later prompt counts an earlier route's untokenized text as predicted on its engine only
    past what that engine's events say it holds (a block held and later evicted must not stay
    predicted: no event would confirm it again)."""
    rnd = random.Random(11)
    tok = HFTokenizer(FIXTURE)
    doc = text(rnd, 8000)
    svc = service()
    _, d1 = route(svc, doc + " Question: " + text(rnd, 1500), 0)
    pod = d1.target.pod
    ids = tok.encode(doc, add_special_tokens=True)
    held = len(ids) // BS // 2
    hold(svc.index, pod, ids, held)  # the engine has reported the first half of the document
    route(svc, doc + " Question: " + text(rnd, 1500), 1)
    m = svc.index.match_tokens("m", ids).get(pod)
    assert m is not None and m.matched_blocks >= len(ids) // BS - 600 // 3 // BS - 1  # the document, as before
    assert m.matched_blocks - m.predicted_blocks == held  # the first half exact...
    assert m.predicted_blocks == m.matched_blocks - held  # ...and only the rest predicted
    # the engine evicts what it reported: the first half is no longer counted there
    from schemas import BlockRemoved

    hashes = [hash((pod, i, tuple(ids[:(i + 1) * BS]))) & (2**63 - 1) or 1 for i in range(held)]
    svc.index.apply(KvEventBatch(pod=pod, model="m", seq=1, ts=time.time(), events=[BlockRemoved(block_hashes=hashes)]))
    assert (svc.index.match_tokens("m", ids).get(pod) or (0,))[0] == 0


def test_a_settled_route_ends_on_its_engine_only():
    from router.lazy_prompt import PieceRoutes

    r = PieceRoutes(ttl_s=30.0)
    r.add("m", [1, 2, 3], "a", now=0.0)
    r.add("m", [3], "b", now=1.0)  # the same text sent to another engine since
    r.settle("m", [1, 2, 3], "a", until=5.0)
    assert [r.get("m", c, 4.0) for c in (1, 2, 3)] == ["a", "a", "b"]
    assert r.get("m", 1, 5.0) is None and r.get("m", 3, 5.0) == "b"  # b's route keeps its time to live
    r.add("m", [4], "a", now=0.0)
    r.settle("m", [4], "a", until=40.0)  # never later than the route's own expiry
    assert r.get("m", 4, 31.0) is None
