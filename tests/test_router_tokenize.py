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
