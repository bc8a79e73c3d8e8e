"""Prompt synthesis: equal hash ids give equal token prefixes (and text), different ids differ."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.tokenizer import SimpleTokenizer
from simulator.workloads.synth import PromptSynthesizer, synthesize
from simulator.workloads.trace import TraceRow


def row(hash_ids, n, out=1):
    return TraceRow(timestamp=0, input_length=n, output_length=out, hash_ids=list(hash_ids))


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_shared_hash_ids_share_exact_token_prefixes():
    s = PromptSynthesizer(block_tokens=512)
    a = s.token_ids(row([1, 2, 3], 1400))
    b = s.token_ids(row([1, 2, 9], 1300))
    c = s.token_ids(row([7, 2, 3], 1400))
    assert len(a) == 1400 and len(b) == 1300
    assert a[:1024] == b[:1024]
    assert a[1024] != b[1024] or a[1025] != b[1025]
    assert common_prefix(a, b) < 1024 + 8
    assert common_prefix(a, c) < 8  # a different first block: no shared prefix
    assert all(1000 <= t < 32000 for t in a)


def test_same_block_everywhere_and_across_instances_and_positions():
    s1, s2 = PromptSynthesizer(), PromptSynthesizer()
    assert np.array_equal(s1.block(42), s2.block(42))
    x = s1.token_ids(row([5, 42], 1024))
    y = s2.token_ids(row([42], 512))
    assert x[512:] == y  # a block's tokens do not depend on where it sits
    assert synthesize(row([5, 42], 1024)) == x
    assert PromptSynthesizer(seed=1).token_ids(row([5], 512)) != x[:512]


def test_tail_block_is_cut_and_missing_blocks_are_private_filler():
    s = PromptSynthesizer(block_tokens=512)
    full = s.token_ids(row([3, 4], 1024))
    assert s.token_ids(row([3, 4], 700)) == full[:700]
    # more tokens than the hash ids cover: the rest is private to the request
    short = row([3], 1200)
    p1 = s.token_ids(short, request_key=1)
    p2 = s.token_ids(short, request_key=2)
    assert len(p1) == 1200 and p1[:512] == full[:512]
    assert common_prefix(p1, p2) < 512 + 8
    assert s.token_ids(short) == s.token_ids(short)  # default key is stable


def test_text_tokenizes_back_to_the_same_ids():
    tok = SimpleTokenizer()
    s = PromptSynthesizer(block_tokens=64)
    for r in (row([1, 2, 3], 150), row([1, 2, 8], 140), row([9], 200)):
        text = s.text(r, request_key=3)
        assert tok.encode(text) == s.token_ids(r, request_key=3)
    t1, t2 = s.text(row([1, 2, 3], 150)), s.text(row([1, 2, 8], 140))
    assert common_prefix(t1, t2) >= len(" ".join(s.text(row([1, 2], 128)).split()))


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        PromptSynthesizer(block_tokens=0)
    with pytest.raises(ValueError):
        PromptSynthesizer(vocab_lo=10, vocab_hi=10)

    class Lossy:
        vocab_size = 50_000

        def decode(self, ids):
            return "same"

        def encode(self, text):
            return [0] * len(text.split())

    from simulator.workloads.synth import TokenizerVocabulary

    with pytest.raises(ValueError, match="one to one"):
        TokenizerVocabulary(Lossy(), 1000, 32000)


@settings(max_examples=40, deadline=None)
@given(a=st.lists(st.integers(0, 10_000), min_size=1, max_size=6),
       b=st.lists(st.integers(0, 10_000), min_size=1, max_size=6),
       la=st.integers(1, 6 * 32), lb=st.integers(1, 6 * 32))
def test_prefix_sharing_property(a, b, la, lb):
    bt = 32
    s = PromptSynthesizer(block_tokens=bt)
    la, lb = min(la, len(a) * bt), min(lb, len(b) * bt)
    x, y = s.token_ids(row(a, la)), s.token_ids(row(b, lb))
    shared_blocks = common_prefix(a, b)
    must_share = min(shared_blocks * bt, la, lb)
    assert x[:must_share] == y[:must_share]
