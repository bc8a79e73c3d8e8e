"""tiktoken's BPE standing in for ``tokenizers`` (simulator/fast_bpe.py): the same ids as
``tokenizers`` on a real production tokenizer.json and on the parity fixture, whole and through
the router's piece memo; configurations it cannot match are refused, and a vocabulary where the
two BPE orders part is caught by the load-time check."""

from __future__ import annotations

import copy
import importlib.util
import json
import lzma
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from simulator import fast_bpe
from simulator.tokenizer import HFTokenizer

FIX = Path(__file__).parent / "fixtures"
PARITY = FIX / "tokenize" / "tokenizer.json"


@pytest.fixture(scope="module")
def claude(tmp_path_factory) -> Path:
    """The anthropic SDK's tokenizer.json (tests/fixtures/bpe/make_fixtures.py), unpacked."""
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    path.write_bytes(lzma.decompress((FIX / "bpe" / "claude-v1.tokenizer.json.xz").read_bytes()))
    return path


def _texts(seed: int, n: int) -> list[str]:
    """Random texts: words, numbers, whitespace runs, punctuation, several scripts, emoji and
    combining marks, contractions; some long."""
    rnd = random.Random(seed)
    atoms = ["the", "The", " quick", "brown", "fox", "'s", "'ll", "'RE", "n't", "1", "23", "4567", "3.14",
             " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "\x0b", "\x85", ".", ",", "!?",
             "--", "()", "{}", "<", ">", "/", "\\", "_", "#", "@", "$", "%", "café", "naïve", "ﬁ", "Ⅻ", "①",
             "２０２６", "中文", "日本語", "한국어", "Ελληνικά", "русский", "عربى", "हिन्दी", "🙂", "👍🏽", "👩‍💻",
             "e\u0301", "x = f(y)", "CamelCase", "snake_case", "w" + "o" * 30, "aaaaaaaa", "1234567890123"]
    out = []
    for _ in range(n):
        k = rnd.choice((1, 3, 10, 40, 200))
        out.append("".join(rnd.choice(atoms) + rnd.choice(("", " ", "", "\n")) for _ in range(k)))
    return out


def _hf_ids(hf: Tokenizer, text: str, specials: bool) -> list[int]:
    return hf.encode(text, add_special_tokens=specials).ids


def test_a_real_tokenizer_converts_and_gives_its_ids(claude):
    hf = Tokenizer.from_file(str(claude))
    fast, why = fast_bpe.load(claude, hf)
    assert why is None and fast is not None
    texts = _texts(1, 2500) + [f"a<EOT>b <META> {t}<META_START>" for t in _texts(2, 50)]
    for t in texts:
        for specials in (False, True):
            assert fast.encode_array(t, specials).tolist() == _hf_ids(hf, t, specials), (t, specials)


def test_the_parity_fixture_converts_with_its_bos_and_added_tokens():
    hf = Tokenizer.from_file(str(PARITY))
    fast, why = fast_bpe.load(PARITY, hf)
    assert why is None
    assert fast.encode_array("hi", True)[0] == hf.token_to_id("<s>")  # the post-processor's BOS
    for t in _texts(3, 800) + ["<|start|>user\nhi<|end|>\n<|start|>assistant", "</s></s><s>", "<|start|"]:
        for specials in (False, True):
            assert fast.encode_array(t, specials).tolist() == _hf_ids(hf, t, specials), (t, specials)


def test_hf_tokenizer_fast_and_plain_agree_whole_and_through_the_piece_memo(claude):
    fast, plain = HFTokenizer(claude, fast=True), HFTokenizer(claude)
    assert fast.fast_off is None and plain.fast_off == "not asked for"
    assert fast.pieces is not None  # long prompts come from memoized pieces, encoded by tiktoken
    rnd = random.Random(5)
    doc = " ".join(_texts(6, 30))
    for t in _texts(7, 60):
        long = doc + " Question: " + t + " " + " ".join(rnd.sample(_texts(8, 20), 5))
        for text in (t, long):
            for specials in (False, True):
                a = fast.encode_array(text, specials)
                assert a.dtype == np.uint32
                assert a.tolist() == plain.encode_array(text, specials).tolist() == plain.encode(text, specials)
    assert fast.pieces.hits > 0 and fast.pieces.misses > 0
    lone = "a \ud800 b"  # not valid Unicode: tokenizers' own handling (an error the router reads as
    for tok in (fast, plain):  # "route without prefix information"), not tiktoken's
        with pytest.raises(TypeError):
            tok.encode(lone, False)


def _config(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def test_configurations_it_cannot_match_are_refused(claude):
    base = _config(claude)
    assert fast_bpe.refusal(base) is None

    def refused(edit) -> str | None:
        c = copy.deepcopy(base)
        edit(c)
        return fast_bpe.refusal(c)

    assert "normalizer" in refused(lambda c: c.__setitem__("normalizer", {"type": "Lowercase"}))
    two_splits = {"type": "Sequence", "pretokenizers": [  # as DeepSeek's: digits, then the rest
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "\\s+|\\S+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    assert "pre-tokenizer" in refused(lambda c: c.__setitem__("pre_tokenizer", two_splits))
    assert "prefix space" in refused(lambda c: c["pre_tokenizer"].__setitem__("add_prefix_space", True))
    assert "dropout" in refused(lambda c: c["model"].__setitem__("dropout", 0.1))
    assert "id order" in refused(lambda c: c["model"]["merges"].reverse())
    assert "256 bytes" in refused(lambda c: c["model"]["vocab"].pop("Ā"))  # byte 0x00
    assert "strips" in refused(lambda c: c["added_tokens"][0].__setitem__("lstrip", True))
    assert "WordPiece" in refused(lambda c: c["model"].__setitem__("type", "WordPiece"))


def _tiny_bpe(merges: list[tuple[str, str]]) -> dict:
    """A byte-level BPE over the 256 bytes plus ``merges`` (ids in merge order), GPT-2's split."""
    table = {b: c for c, b in fast_bpe.byte_of_char().items()}
    vocab = {table[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return {"version": "1.0", "added_tokens": [], "normalizer": None, "post_processor": None, "decoder": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]}}


def test_where_the_two_bpe_orders_part_the_load_checks_refuse(tmp_path, monkeypatch):
    # "he" is merged first, so tokenizers reads "the" as t + he; tiktoken also joins t + he, since
    # its bytes are the token "the" (made by the merge th + e, which tokenizers never reaches)
    parting = tmp_path / "parting.json"
    parting.write_text(json.dumps(_tiny_bpe([("h", "e"), ("t", "h"), ("th", "e")])))
    hf = Tokenizer.from_file(str(parting))
    assert fast_bpe.refusal(_config(parting)) is None  # the file's shape alone does not tell
    assert hf.encode("the", add_special_tokens=False).ids != [hf.token_to_id("the")]
    fast, why = fast_bpe.load(parting, hf)
    assert fast is None and "of its own bytes" in why
    # and were that check gone, the sample would catch it
    monkeypatch.setattr(fast_bpe, "_self_made", lambda config, hf: None)
    fast, why = fast_bpe.load(parting, hf)
    assert fast is None and "differ" in why
    assert HFTokenizer(parting, fast=True).fast_off == why  # and the tokenizer keeps tokenizers' ids

    agreeing = tmp_path / "agreeing.json"  # the same tokens, merged in an order both read alike
    agreeing.write_text(json.dumps(_tiny_bpe([("t", "h"), ("h", "e"), ("th", "e")])))
    fast, why = fast_bpe.load(agreeing, Tokenizer.from_file(str(agreeing)))
    assert why is None and fast.encode_array("the the", False).tolist() == [258, 32, 258]


def test_a_split_regex_that_leaves_characters_out_is_refused(claude, tmp_path):
    # tiktoken drops what its regex does not match, tokenizers keeps it as a piece of its own
    c = _config(claude)
    c["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\p{N}+|\\s+|[\\p{P}\\p{S}]+"}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(c))
    assert fast_bpe.refusal(c) is None
    fast, why = fast_bpe.load(path, Tokenizer.from_file(str(path)))
    assert fast is None and "differ" in why


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("shape", ["llama3", "qwen2"])
def test_llama3_and_qwen2_shaped_tokenizers_convert(shape, tmp_path):
    """Trained here in their shapes: one Split regex (Llama 3's; Qwen 2's with single digits)
    before a regex-less ByteLevel, ``ignore_merges`` as both set it; Llama 3 with its BOS
    post-processor and special tokens, Qwen 2 with its NFC normalizer and none added."""
    import sysconfig

    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers

    spec = importlib.util.spec_from_file_location("bench_tokenizer", Path(__file__).parent.parent / "bench"
                                                  / "bench_tokenizer.py")
    bench_tokenizer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_tokenizer)
    LLAMA3_SPLIT = bench_tokenizer.LLAMA3_SPLIT  # noqa: N806 - Llama 3's own regex

    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"] \
        if shape == "llama3" else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    if shape == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT if shape == "llama3" else QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    lib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [p.read_text(encoding="utf-8") for p in sorted(lib.glob("[a-f]*.py"))][:40] + _texts(9, 300)
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=3000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if shape == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    config = _config(path)
    config["model"]["ignore_merges"] = True
    path.write_text(json.dumps(config))
    hf = Tokenizer.from_file(str(path))
    fast, why = fast_bpe.load(path, hf)
    assert why is None
    texts = _texts(10, 1500) + [f"{s}user{s}\nhi{s}" for s in specials]
    for t in texts:
        for add in (False, True):
            assert fast.encode_array(t, add).tolist() == _hf_ids(hf, t, add), (shape, t, add)
    if shape == "llama3":
        assert fast.encode_array("x", True)[0] == hf.token_to_id("<|begin_of_text|>")


def test_long_runs_of_one_character_give_tokenizers_ids(claude):
    # one pre-token of thousands of bytes: the BPE's worst case (merges across the whole run)
    hf = Tokenizer.from_file(str(claude))
    fast, why = fast_bpe.load(claude, hf)
    assert why is None
    for s in ("a" * 20000, " " * 20000, "7" * 20000, "ab" * 10000, "!?" * 10000, "\n" * 5000 + "x",
              "é" * 8000, "🙂" * 3000):
        assert fast.encode_array(s, True).tolist() == _hf_ids(hf, s, True), s[:5]
