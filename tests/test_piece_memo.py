"""Long prompts through a Hugging Face tokenizer from memoized pieces (simulator.piece_memo): the
ids joined are the whole text's ids, for the fixture byte-level BPE and for a tokenizer built
here with Llama 3's pre-tokenizer; configurations where a cut could change the ids are refused."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import piece_memo
from simulator.tokenizer import HFTokenizer, RenderedChat

FIXTURE = Path(__file__).parent / "fixtures" / "tokenize"
# Llama 3's pre-tokenizer regex (its tokenizer.json, "pre_tokenizer" -> Split -> pattern)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
WORDS = ["the", "cache", "router", "prefill", "KV", "decode", "Ascend", "vLLM", "über", "naïve", "数据",
         "x2", "42", "3.14", "(", ")", ",", ".", "--", "'s", "don't", "snake_case", "CamelCase", "\n", "\t",
         "  ", "\n\n", "a", "I", "😀", "<|start|>", "<s>"]


@functools.cache
def _fixture_tokenizer() -> HFTokenizer:
    return HFTokenizer(FIXTURE)


def _text(rnd: random.Random, n_words: int) -> str:
    out = []
    for _ in range(n_words):
        w = rnd.choice(WORDS)
        out.append(w)
        out.append(rnd.choice([" ", " ", " ", "", "\n", "  "]))
    return "".join(out)


@pytest.fixture(scope="module")
def fixture_tok():
    return HFTokenizer(FIXTURE)


@pytest.fixture(scope="module")
def llama3_style(tmp_path_factory):
    """A byte-level BPE trained here on the words above, with Llama 3's Split + ByteLevel
    pre-tokenizer and a BOS post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    rnd = random.Random(7)
    tok.train_from_iterator([_text(rnd, 60) for _ in range(300)],
                            trainers.BpeTrainer(vocab_size=600, special_tokens=["<|begin_of_text|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    d = tmp_path_factory.mktemp("llama3-style")
    tok.save(str(d / "tokenizer.json"))
    return HFTokenizer(d)


@pytest.mark.parametrize("which", ["fixture_tok", "llama3_style"])
def test_pieces_joined_are_the_whole_texts_ids(which, request):
    tok = request.getfixturevalue(which)
    assert tok.pieces is not None, tok.pieces_off
    memo = piece_memo.PieceMemo(tok._encode_batch, piece=40)  # small pieces: many cuts per text
    rnd = random.Random(3)
    cut_texts = 0
    for _ in range(150):
        text = _text(rnd, rnd.randint(5, 120))
        for specials in (True, False):
            whole = tok._tok.encode(text, add_special_tokens=specials).ids
            got = memo.encode(text, specials)
            if got is not None:
                cut_texts += 1
                assert got.tolist() == whole, text
    assert cut_texts > 100
    assert memo.hits > 0 and memo.misses > 0


@given(st.text(alphabet=st.sampled_from(list("ab Z9 ,.'\n\té😀-")), min_size=0, max_size=300))
@settings(max_examples=300, deadline=None)
def test_any_text_cut_anywhere_allowed_keeps_the_ids(text):
    tok = _fixture_tokenizer()
    memo = piece_memo.PieceMemo(tok._encode_batch, piece=3)
    got = memo.encode(text, True)
    if got is not None:
        assert got.tolist() == tok._tok.encode(text, add_special_tokens=True).ids


def test_a_shared_prefix_is_encoded_once_and_the_tokenizer_uses_the_memo(fixture_tok):
    rnd = random.Random(11)
    doc = _text(rnd, 3000)  # well over two pieces
    assert len(doc) > 4 * piece_memo.PIECE
    tok = HFTokenizer(FIXTURE)
    first = tok.encode(doc + " first question?")
    misses = tok.pieces.misses
    second = tok.encode(doc + " second question, longer than the first?")
    assert first == tok._tok.encode(doc + " first question?", add_special_tokens=True).ids
    assert second == tok._tok.encode(doc + " second question, longer than the first?", add_special_tokens=True).ids
    assert tok.pieces.misses - misses == 1  # only the last piece (the question) was encoded again
    assert tok.pieces.hits >= len(piece_memo.cuts(doc)) - 1
    # a rendered chat gets no special tokens, and its pieces are keyed apart from a BOS-led first piece
    chat = tok.encode(RenderedChat(doc + " first question?"))
    assert chat == tok._tok.encode(doc + " first question?", add_special_tokens=False).ids
    assert chat != first
    assert tok.encode_array(doc + " first question?").tolist() == first


def test_cuts_fall_only_between_a_word_and_a_following_word():
    text = "alpha beta, gamma  delta\nepsilon zeta 12 eta (theta) iota"
    cs = piece_memo.cuts(text, 1)
    assert cs
    for c in cs:
        assert text[c] == " " and text[c - 1].isalnum() and text[c + 1].isalpha()
    # no admissible space: no cut
    assert piece_memo.cuts("a, b, c, d, e, f", 1) == []


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="ab Z9 .,\né-", max_size=300), st.sampled_from([1, 2, 3, 7, 37, 128]))
def test_each_cut_is_the_first_safe_space_at_least_size_after_the_last(text, size):
    ascii_alnum = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    safe = [c for c in range(1, len(text) - 1)
            if text[c] == " " and text[c - 1] in ascii_alnum and text[c + 1] in ascii_alnum - set("0123456789")]
    want, s = [], size
    for c in safe:
        if c >= s:
            want.append(c)
            s = c + size
    assert piece_memo.cuts(text, size) == want


def _config(**over):
    cfg = json.loads((FIXTURE / "tokenizer.json").read_text())
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("over, reason", [
    ({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}}, "Metaspace"),
    ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}}, "prefix space"),
    ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}}, "regex"),
    ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}]}}, "split"),
    ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}]}}, "normalizer"),
    ({"model": {"type": "WordPiece", "vocab": {}}}, "WordPiece"),
    ({"added_tokens": [{"id": 9, "content": "<|two words|>"}, {"id": 10, "content": "[MY TOKEN]"}]}, "space"),
])
def test_unsafe_configurations_are_refused(over, reason):
    why = piece_memo.piece_safe(_config(**over))
    assert why is not None and reason in why


def test_llama3_style_configuration_is_accepted():
    cfg = _config(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]})
    assert piece_memo.piece_safe(cfg) is None


def test_a_tokenizer_whose_pieces_disagree_is_caught_by_the_self_check(fixture_tok):
    def per_call_marker(texts, specials):  # adds a token at every call: pieces would differ from whole
        return [[7] + fixture_tok._tok.encode(t, add_special_tokens=specials).ids for t in texts]

    assert not piece_memo.self_check(fixture_tok._encode_whole, per_call_marker)
    assert piece_memo.self_check(fixture_tok._encode_whole, fixture_tok._encode_batch)


def test_the_memo_is_bounded_by_characters(fixture_tok):
    memo = piece_memo.PieceMemo(fixture_tok._encode_batch, piece=50, max_chars=2000)
    rnd = random.Random(5)
    for _ in range(40):
        memo.encode(_text(rnd, 80), False)
    assert memo._chars <= 2000 + 200  # one piece past the bound at most before eviction
    assert sum(c for _, c in memo._held.values()) == memo._chars


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 400), st.booleans())
def test_the_offset_free_batch_encoder_gives_encode_s_ids(seed, n_words, specials):
    """HFTokenizer encodes with tokenizers' batch encoder without offsets (a batch of one for whole
    text, so the GIL is released): the ids of its plain single-text encode, whatever the text."""
    tok = _fixture_tokenizer()
    text = _text(random.Random(seed), n_words)
    want = tok._tok.encode(text, add_special_tokens=specials).ids
    assert tok._encode_whole(text, specials) == want
    assert tok._encode_batch([text, text[: len(text) // 2]], specials) == [
        want, tok._tok.encode(text[: len(text) // 2], add_special_tokens=specials).ids]
