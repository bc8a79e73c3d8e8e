"""Prompt -> token ids as the engines compute them (simple tokenizer, or a local tokenizer.json)."""

from __future__ import annotations

from router.tokenize import PromptEncoder
from simulator.tokenizer import SimpleTokenizer, simple_chat_template


def test_simple_matches_the_simulator_and_handles_bad_prompts():
    enc = PromptEncoder("simple")
    tok = SimpleTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    assert enc.encode("chat", {"messages": msgs}) == tok.encode(simple_chat_template(msgs))
    assert enc.encode("completions", {"prompt": "a b c"}) == tok.encode("a b c")
    assert enc.encode("completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert enc.encode("completions", {"prompt": {"bad": 1}}) is None  # routed without prefix info
    assert PromptEncoder(None).encode("completions", {"prompt": "x"}) is None


def test_local_hugging_face_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<": 3, "|": 4, "user": 5, ">": 6, "assistant": 7}
    t = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    enc = PromptEncoder(str(tmp_path))
    assert enc.encode("completions", {"prompt": "hello world"}) == [1, 2]
    ids = enc.encode("chat", {"messages": [{"role": "user", "content": "hello"}]})
    assert 1 in ids and 5 in ids and 7 in ids  # the chat template was applied before encoding
    # the routing path's array form is the same tokenizer's ids (long ASCII text: where the toy
    # tokenizer would take its compiled path), never another tokenizer's
    long = {"prompt": "hello world " * 60}
    assert list(enc.encode("completions", long, as_array=True)) == enc.encode("completions", long) == [1, 2] * 60


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_TEXT = st.lists(st.sampled_from(list("bdfgkaeiou ") + ["  ", "\n", "\t", ".", ",", "é", "_", "7", "\u3000",
                                                        "\x1c", "!?", "ba", "zu", "kimo "]),
                 max_size=400).map("".join)


@settings(max_examples=200, deadline=None)
@given(_TEXT, _TEXT)
def test_simple_tokenizer_equals_the_plain_regex_whatever_the_text(a, b):
    """The fast paths (pieces memoized, words-only pieces split at whitespace) give exactly what one
    regex pass gives, on text with and without punctuation, odd whitespace and shared prefixes."""
    import re

    from simulator.tokenizer import SimpleTokenizer

    tok = SimpleTokenizer(memo_pieces=8)
    ref = SimpleTokenizer()

    def plain(text):
        return [ref.token_for_word(w) for w in re.findall(r"\w+|[^\w\s]", text)]

    for text in (a, a + b, b + a, a):  # a shared prefix, then a repeat (memo hits)
        assert tok.encode(text) == plain(text)


_ASCII = st.lists(st.sampled_from(list("bdfgkaeiouz ") + ["  ", "\n", "\t", "\x0b", "\x1c", "\x1f", ".", ",", "_",
                                                         "7", "Q", "\x00", "\x7f", "!?", "ba", "zu", "kimo ",
                                                         "bababa", "zuzuzuzuzuzuzuzu", "word_9 "]),
                  min_size=80, max_size=600).map("".join)


@settings(max_examples=150, deadline=None)
@given(_ASCII, st.sampled_from([40, 100, 4901, 32_000, 151_000]))
def test_compiled_ascii_path_gives_the_python_ids(text, vocab):
    """Long ASCII text goes through the numba kernel (one pass over the bytes): the same ids as the
    Python path (memoized pieces, the regex and xxhash), for canonical syllable words near and past
    the vocabulary's end, other words, punctuation, control characters and every ASCII space."""
    import re

    import pytest

    from simulator import tokenizer as T

    if T._ascii_kernel() is None:
        pytest.skip("numba is not installed (the router extra)")
    text = text * (1 + 300 // max(1, len(text)))  # past one piece: the compiled path
    assert len(text) > T._CHUNK and text.isascii()
    ref = SimpleTokenizer(vocab)
    plain = [ref.token_for_word(w) for w in re.findall(r"\w+|[^\w\s]", text)]
    assert SimpleTokenizer(vocab).encode(text) == plain
    arr = SimpleTokenizer(vocab).encode_array(text)  # the router's form: the same ids as uint32
    assert arr.dtype == "uint32" and arr.tolist() == plain
    assert SimpleTokenizer(vocab).encode_array(text[:20] + "é").tolist() == ref.encode(text[:20] + "é")


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_compiled_xxh64_is_xxhash(data):
    import numpy as np
    import pytest
    import xxhash

    from simulator import tokenizer as T

    if T._ascii_kernel() is None:
        pytest.skip("numba is not installed (the router extra)")
    arr = np.frombuffer(data, dtype=np.uint8) if data else np.zeros(0, dtype=np.uint8)
    assert int(T._ascii_kernel().xxh64(arr, 0, len(data))) == xxhash.xxh64_intdigest(data)


@settings(max_examples=40, deadline=None)
@given(_ASCII, _ASCII, st.integers(1, 3))
def test_long_text_is_tokenized_in_memoized_pieces_with_the_same_ids(a, b, reps):
    """Text longer than two pieces goes piece by piece, each piece's ids memoized: a prompt that
    extends an earlier one (the next turn of a conversation) gives exactly the one-pass ids, from
    the memo for the shared part, and the memo stays within its character budget."""
    import re

    import pytest

    from simulator import tokenizer as T

    if T._ascii_kernel() is None:
        pytest.skip("numba is not installed (the router extra)")
    first = (a * (1 + 3 * T._PIECE // max(1, len(a))))[: 3 * T._PIECE + reps * 700]
    turn2 = first + " " + b * reps
    ref = SimpleTokenizer(151_000)
    tok = SimpleTokenizer(151_000)
    tok._pieces_max = 6 * T._PIECE  # small: evictions happen within the example
    for text in (first, turn2, first, turn2 + first):
        plain = [ref.token_for_word(w) for w in re.findall(r"\w+|[^\w\s]", text)]
        assert tok.encode_array(text).tolist() == plain
        assert tok.encode(text) == plain
        assert tok._pieces_chars == sum(c for _, c in tok._pieces.values()) <= tok._pieces_max
    # the next turn runs the kernel over what the first did not hold only: its last piece and the rest
    fresh = SimpleTokenizer(151_000)
    fresh.encode_array(first)
    last = list(fresh._pieces.values())[-1][1]
    passes: list[int] = []
    kernel_marks = fresh._kernel_marks
    fresh._kernel_marks = lambda k, b, start, cuts: passes.append(len(b) - start) or kernel_marks(k, b, start, cuts)
    assert fresh.encode_array(turn2).tolist() == [ref.token_for_word(w) for w in re.findall(r"\w+|[^\w\s]", turn2)]
    assert len(passes) == 1 and passes[0] <= len(turn2) - (len(first) - last)
