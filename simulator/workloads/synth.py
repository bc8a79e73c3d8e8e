"""Prompt synthesis: a trace's ``hash_ids`` become real tokens and text.

Every hash id maps to the same ``block_tokens`` token ids wherever it appears (a stateless
hash of ``(seed, hash_id, position)``, so no table is kept and any process derives the same
ids). A request's prompt is its blocks in order, cut to ``input_length``; requests that share
leading hash ids therefore share a real token prefix, and so the same engine KV blocks, the
same index hashes and the same text.

Text: each token id maps 1:1 to a word (a :class:`Vocabulary`; by default the words of the
simulator's :class:`~simulator.tokenizer.SimpleTokenizer`), words are joined by single spaces,
so tokenizing the text with that tokenizer gives back exactly the ids.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Protocol

import numpy as np
import xxhash

from simulator.tokenizer import SimpleTokenizer
from simulator.workloads.trace import TraceRow, encode_row

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_PRIVATE_SALT = 0x5EED_7A11_0000_0001  # keeps request-private filler apart from trace hash ids


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised; uint64 arithmetic wraps as intended."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


_MASK = 0xFFFFFFFFFFFFFFFF


def _mix64(*parts: int) -> int:
    """Scalar splitmix64 chain over ``parts`` (stable across processes and versions)."""
    acc = 0
    for p in parts:
        x = (acc ^ (p & _MASK)) & _MASK
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & _MASK
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
        acc = (x + 0x9E3779B97F4A7C15) & _MASK
    return acc


class Vocabulary(Protocol):
    """Maps token ids to words one to one (``word(i)`` distinct for distinct ``i``, no spaces)."""

    def word(self, token_id: int) -> str: ...


class TokenizerVocabulary:
    """Words from a tokenizer whose ``decode`` of one id gives a word that ``encode`` maps
    back to that id (the simulator's :class:`~simulator.tokenizer.SimpleTokenizer` does).

    The round trip is checked on a sample of ``[lo, hi)`` when built, so a tokenizer that
    cannot give exact text (most BPE tokenizers) is refused with a clear error.
    """

    def __init__(self, tokenizer, lo: int, hi: int, check: int = 64):  # noqa: ANN001
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if vocab_size is not None and hi > vocab_size:
            raise ValueError(f"token ids up to {hi} do not fit the tokenizer's vocabulary of {vocab_size}")
        self._tok = tokenizer
        self._cache: dict[int, str] = {}
        step = max(1, (hi - lo) // check)
        sample = list(range(lo, hi, step))[:check] + [hi - 1]
        words = [self.word(i) for i in sample]
        if tokenizer.encode(" ".join(words)) != sample:
            raise ValueError(f"{type(tokenizer).__name__} does not map ids to words one to one; "
                             "text prompts would not tokenize back to the synthesized ids")

    def word(self, token_id: int) -> str:
        w = self._cache.get(token_id)
        if w is None:
            w = self._tok.decode([token_id]).strip()
            if not w or any(c.isspace() for c in w):
                raise ValueError(f"token id {token_id} has no single-word form")
            self._cache[token_id] = w
        return w


class _Lru:
    def __init__(self, size: int):
        self.size = size
        self.data: OrderedDict = OrderedDict()

    def get(self, key):
        v = self.data.get(key)
        if v is not None:
            self.data.move_to_end(key)
        return v

    def put(self, key, value) -> None:
        self.data[key] = value
        if len(self.data) > self.size:
            self.data.popitem(last=False)


class PromptSynthesizer:
    """Token ids and text for trace rows.

    ``vocab_lo``/``vocab_hi``: token ids are drawn in ``[vocab_lo, vocab_hi)`` (keep them
    inside the engine's vocabulary and clear of special tokens). ``seed`` changes every block.
    """

    def __init__(self, *, block_tokens: int = 512, vocab_lo: int = 1000, vocab_hi: int = 32000,
                 seed: int = 0, vocabulary: Vocabulary | None = None, cache_blocks: int = 16384):
        if block_tokens <= 0:
            raise ValueError("block_tokens must be > 0")
        if not 0 <= vocab_lo < vocab_hi:
            raise ValueError(f"need 0 <= vocab_lo < vocab_hi, got [{vocab_lo}, {vocab_hi})")
        self.block_tokens = block_tokens
        self.vocab_lo = vocab_lo
        self.vocab_hi = vocab_hi
        self.seed = seed
        if vocabulary is None:
            vocabulary = TokenizerVocabulary(SimpleTokenizer(max(32_000, vocab_hi)), vocab_lo, vocab_hi)
        self.vocabulary: Vocabulary = vocabulary
        self._positions = np.arange(block_tokens, dtype=np.uint64) * _GOLDEN
        self._tok_cache = _Lru(cache_blocks)
        self._text_cache = _Lru(max(1, cache_blocks // 4))
        self._word_table: np.ndarray | None = None

    # -- blocks -------------------------------------------------------------------------
    def _gen(self, keys: list[int]) -> np.ndarray:
        """Token ids of blocks keyed ``keys``, shape ``(len(keys), block_tokens)``, int32.

        Token ``j`` of key ``k`` is ``lo + span * (splitmix(base(k) + j*golden) >> 32) >> 32``;
        one vectorised pass for all the keys a request misses."""
        bases = np.fromiter((_mix64(self.seed, k) for k in keys), dtype=np.uint64, count=len(keys))
        x = _splitmix(bases[:, None] + self._positions[None, :])
        span = np.uint64(self.vocab_hi - self.vocab_lo)
        out = (((x >> np.uint64(32)) * span) >> np.uint64(32)).astype(np.int32)
        out += self.vocab_lo
        out.setflags(write=False)
        return out

    def blocks(self, hash_ids: list[int]) -> list[np.ndarray]:
        """The token arrays of ``hash_ids`` (read-only, cached), generating misses together."""
        cache = self._tok_cache
        found = [cache.get(h) for h in hash_ids]
        missing = [h for h, a in zip(hash_ids, found) if a is None]
        if missing:
            fresh = dict(zip(missing, self._gen(missing)))
            for h, arr in fresh.items():
                cache.put(h, arr)
            found = [a if a is not None else fresh[h] for h, a in zip(hash_ids, found)]
        return found

    def block(self, hash_id: int) -> np.ndarray:
        """The ``block_tokens`` token ids of one hash id (read-only array; cached)."""
        return self.blocks([hash_id])[0]

    def _words_of(self, ids: np.ndarray) -> str:
        """Words of token ids in ``[vocab_lo, vocab_hi)`` joined by spaces; the word table
        is built once on first use."""
        if self._word_table is None:
            word = self.vocabulary.word
            self._word_table = np.array([word(i) for i in range(self.vocab_lo, self.vocab_hi)], dtype=object)
        return " ".join(self._word_table[ids - self.vocab_lo].tolist())

    def block_text(self, hash_id: int) -> str:
        """The words of one whole block joined by spaces (cached)."""
        text = self._text_cache.get(hash_id)
        if text is None:
            text = self._words_of(self.block(hash_id))
            self._text_cache.put(hash_id, text)
        return text

    def _private_blocks(self, request_key: int, count: int) -> np.ndarray:
        return self._gen([_mix64(_PRIVATE_SALT, request_key, i) for i in range(count)])

    @staticmethod
    def request_key(row: TraceRow) -> int:
        """A stable key for a row's request-private filler, used only when the trace has
        fewer hash ids than ``input_length`` needs (two identical rows share it)."""
        return xxhash.xxh64_intdigest(encode_row(row))

    # -- requests -----------------------------------------------------------------------
    def _plan(self, row: TraceRow) -> tuple[list[int], int, int]:
        """(hash ids used, private blocks needed, tokens kept of the last block)."""
        n = row.input_length
        b = self.block_tokens
        full = -(-n // b) if n else 0
        used = list(row.hash_ids[:full])
        extra = full - len(used)
        tail = n - (full - 1) * b if full else 0
        return used, extra, tail

    def token_blocks(self, row: TraceRow, request_key: int | None = None) -> list[np.ndarray]:
        """The prompt as a list of block arrays (the last one cut), without concatenating:
        for callers that hash or compare block by block."""
        used, extra, tail = self._plan(row)
        parts = self.blocks(used)
        if extra:
            key = self.request_key(row) if request_key is None else request_key
            parts += list(self._private_blocks(key, extra))
        if parts and tail < self.block_tokens:
            parts[-1] = parts[-1][:tail]
        return parts

    def token_array(self, row: TraceRow, request_key: int | None = None) -> np.ndarray:
        """The prompt as one int32 array of ``input_length`` token ids."""
        parts = self.token_blocks(row, request_key)
        if not parts:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(parts)

    def token_ids(self, row: TraceRow, request_key: int | None = None) -> list[int]:
        """The prompt as token ids: ``input_length`` of them, shared ids give shared prefixes."""
        return self.token_array(row, request_key).tolist()

    def text(self, row: TraceRow, request_key: int | None = None) -> str:
        """The prompt as text whose word tokenization is exactly :meth:`token_ids`."""
        used, extra, tail = self._plan(row)
        if not used and not extra:
            return ""
        pieces = [self.block_text(h) for h in used]
        private = None
        if extra:
            key = self.request_key(row) if request_key is None else request_key
            private = self._private_blocks(key, extra)
            pieces += [self._words_of(arr) for arr in private]
        if tail < self.block_tokens:  # cut the last block to the prompt's length
            last = private[-1] if private is not None else self.block(used[-1])
            pieces[-1] = self._words_of(last[:tail])
        return " ".join(pieces)


@functools.lru_cache(maxsize=4)
def default_synthesizer(block_tokens: int = 512) -> PromptSynthesizer:
    """A shared synthesizer with the defaults (seed 0, ids in [1000, 32000))."""
    return PromptSynthesizer(block_tokens=block_tokens)


def synthesize(row: TraceRow, block_tokens: int = 512) -> list[int]:
    """Token ids of a row with the default synthesizer."""
    return default_synthesizer(block_tokens).token_ids(row)


def synthesize_text(row: TraceRow, block_tokens: int = 512) -> str:
    """Text of a row with the default synthesizer (tokenizes back to :func:`synthesize`)."""
    return default_synthesizer(block_tokens).text(row)
