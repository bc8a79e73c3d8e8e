"""Memoized pieces of long text for a Hugging Face tokenizer (``tokenizers``' ``tokenizer.json``).

Prompts that a KV-aware router sees share long prefixes (a system prompt, a document, every
earlier turn of a conversation), and a byte-level BPE tokenizer spends milliseconds on a few
thousand characters. Here long text is cut into pieces of about :data:`PIECE` characters, each
piece's ids are kept under a 128-bit hash of its text, and only the pieces not held are encoded
(in one ``encode_batch`` call).

The ids joined must be the ids of the whole text, so a cut is made only where the tokenizer's
pre-tokenizer always splits: just before a space that follows an ASCII letter or digit and
precedes an ASCII letter (``"...word| next"``). Byte-level pre-tokenizers (GPT-2's regex,
Llama 3's and Qwen's ``Split`` + ``ByteLevel``) end a letter or digit run at a space and start a
new pre-token with the space and the letters after it, and BPE merges never cross pre-tokens.
:func:`piece_safe` accepts only such configurations (no normalizer that could join characters
across the cut, no added token that contains a space); a tokenizer it refuses is used whole, as
before. :func:`self_check` also compares the joined ids with a whole encoding of a sample text,
which the tokenizer runs when it is loaded.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

PIECE = 512  # characters per piece, at least (a piece ends at the first safe cut after that)
SUB_PIECE = 128  # characters per sub-piece: the first piece not held is tokenized this finely (PiecePlan.ids_at)
MEMO_CHARS = 8 << 20  # text held, in characters, at most (least recently used first out): <= 32 MB of ids
_SAFE_CUT = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")  # (the lookbehind sees before the search's start)
_SAFE_NORMALIZERS = {None, "NFC", "NFKC"}  # per character; none reaches across an ASCII space


def _pre_tokenizer_ok(pre: Any) -> str | None:
    """None when ``pre`` (a ``tokenizer.json`` pre_tokenizer) always splits before ``" word"``
    after a letter or digit; else why not."""
    if not isinstance(pre, dict):
        return "no pre-tokenizer"
    kind = pre.get("type")
    if kind == "ByteLevel":
        if not pre.get("use_regex", True):
            return "ByteLevel without its regex"
        if pre.get("add_prefix_space"):
            return "ByteLevel adds a prefix space to each piece"
        return None
    if kind == "Sequence":
        parts = pre.get("pretokenizers") or []
        splits = [p for p in parts if isinstance(p, dict) and p.get("type") == "Split"]
        rest = [p for p in parts if not (isinstance(p, dict) and p.get("type") == "Split")]
        if not splits:
            return "a pre-tokenizer sequence without a regex split"
        for p in splits:
            if p.get("behavior") not in ("Isolated", "Removed") or "Regex" not in (p.get("pattern") or {}):
                return "a Split that is not an isolating regex"
        for p in rest:
            if p.get("type") == "ByteLevel":
                if p.get("add_prefix_space"):
                    return "ByteLevel adds a prefix space to each piece"
            elif p.get("type") != "Digits":
                return f"pre-tokenizer {p.get('type')!r} in the sequence"
        return None
    return f"pre-tokenizer {kind!r}"


def piece_safe(config: dict[str, Any]) -> str | None:
    """None when a tokenizer with this ``tokenizer.json`` content encodes text cut by
    :func:`cuts` piece by piece into the same ids as whole; else the reason it may not."""
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return f"model {model.get('type')!r} (only BPE is checked)"
    if model.get("dropout"):
        return "BPE dropout (ids are random)"
    norm = config.get("normalizer")
    if (norm or {}).get("type") not in _SAFE_NORMALIZERS:
        return f"normalizer {(norm or {}).get('type')!r}"
    for tok in config.get("added_tokens") or []:
        if " " in str(tok.get("content", "")):
            return f"added token {tok.get('content')!r} contains a space"
    return _pre_tokenizer_ok(config.get("pre_tokenizer"))


def cuts(text: str, size: int = PIECE) -> list[int]:
    """Offsets where ``text`` is cut: the first safe cut at or after each ``size`` characters
    from the previous one (a space after an ASCII letter or digit, before an ASCII letter)."""
    out = []
    n = len(text)
    search = _SAFE_CUT.search
    s = size
    while s < n - 1 and (m := search(text, s)) is not None:
        s = m.start()
        out.append(s)
        s += size
    return out


def take(memo: OrderedDict, keys: Sequence[int]) -> list[np.ndarray | None]:
    """The ids held under each key of an LRU piece memo (``key -> (ids, characters)``; None where
    not held), each found one marked recently used."""
    out: list[np.ndarray | None] = []
    for k in keys:
        v = memo.get(k)
        if v is None:
            out.append(None)
        else:
            memo.move_to_end(k)
            out.append(v[0])
    return out


def keep(memo: OrderedDict, key: int, ids: np.ndarray, chars: int, held: int, limit: int) -> int:
    """Put a piece's ``ids`` (``chars`` characters) under ``key`` in an LRU piece memo holding
    ``held`` characters, the least recently used out past ``limit``; the characters held after."""
    old = memo.pop(key, None)
    if old is not None:
        held -= old[1]
    memo[key] = (ids, chars)
    held += chars
    while held > limit and len(memo) > 1:
        held -= memo.popitem(last=False)[1][1]
    return held


class PieceMemo:
    """Ids of long text from memoized pieces (kept as ``uint32`` arrays). ``encode_batch(texts,
    add_special_tokens)`` is the tokenizer's own batch encoder returning one id list per text.

    Thread-safe: the memo is read and updated under a lock, the missing pieces are encoded
    outside it (two threads missing the same piece both encode it; the ids are the same)."""

    def __init__(self, encode_batch: Callable[[list[str], bool], list[list[int]]], *, piece: int = PIECE,
                 max_chars: int = MEMO_CHARS):
        self._encode_batch = encode_batch
        self.piece = piece
        self.max_chars = max_chars
        self._held: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0  # pieces taken from the memo
        self.misses = 0  # pieces encoded

    def encode(self, text: str, add_special_tokens: bool) -> np.ndarray | None:
        """The ids of ``text`` (``uint32``), or None when it has no cut (encode it whole)."""
        plan = self.plan(text, add_special_tokens)
        return None if plan is None else plan.ids(len(plan.pieces))

    def plan(self, text: str, add_special_tokens: bool) -> "PiecePlan | None":
        """``text`` cut into pieces, tokenized on demand from the front (:class:`PiecePlan`), or
        None when it has no cut."""
        cs = cuts(text, self.piece)
        if not cs:
            return None
        return PiecePlan(self, text, [0, *cs, len(text)], add_special_tokens, self._sub_cuts)

    def _sub_cuts(self, piece: str) -> list[int]:
        return cuts(piece, max(1, min(SUB_PIECE, self.piece // 4)))

    def put(self, key: int, ids: np.ndarray, chars: int) -> None:
        """Keep ``ids`` (of a piece of ``chars`` characters) under ``key``, the least recently used
        pieces out past ``max_chars``."""
        with self._lock:
            self._chars = keep(self._held, key, ids, chars, self._chars, self.max_chars)

    def _take(self, keys: list[int]) -> list[np.ndarray | None]:
        """The memo's ids of each key (None where not held), marked recently used."""
        with self._lock:
            found = take(self._held, keys)
            n = sum(1 for f in found if f is not None)
            self.hits += n
            self.misses += len(keys) - n
        return found

    def _fill(self, pieces: list[str], keys: list[int], found: list[np.ndarray | None], first_special: bool) -> None:
        """Encode the pieces not found (one batch; the first with the special tokens when
        ``first_special``) and keep them."""
        missing = [i for i, f in enumerate(found) if f is None]
        if not missing:
            return
        first = missing[0] == 0 and first_special
        if first:  # the first piece with the special tokens, the rest without
            found[0] = np.asarray(self._encode_batch([pieces[0]], True)[0], dtype=np.uint32)
        rest = missing[1:] if first else missing
        if rest:
            for i, ids in zip(rest, self._encode_batch([pieces[i] for i in rest], False)):
                found[i] = np.asarray(ids, dtype=np.uint32)
        for i in missing:
            self.put(keys[i], found[i], len(pieces[i]))


class PiecePlan:
    """A long text as memo pieces, tokenized from the front only as far as asked.

    ``keys[i]`` is piece ``i``'s memo key (a 128-bit hash of its text; the first piece keyed apart
    when it carries the special tokens), ``chain(i)`` a key of the text up to and including piece
    ``i``. ``lead`` is how many leading pieces the memo held when the plan was made (their ids
    cost a lookup). ``ids(k)`` is the ids of the first ``k`` pieces: exactly the whole text's ids
    when ``k`` is every piece, and a prefix of them otherwise (cuts fall where the tokenizer
    always splits).

    A piece can be tokenized in finer steps: ``sub_cut(piece text)`` gives safe cuts inside it
    (sub-pieces, memoized like pieces under the hash of their text), and ``ids_at(k, j)`` is the
    ids of the first ``k`` pieces and the first ``j`` sub-pieces of piece ``k``. The first piece
    not held usually holds both text an engine holds (the end of a shared document) and new text
    (a new question): its sub-pieces up to the new text are held from an earlier prompt, and only
    the one where the text parts needs encoding. Thread-safe as the memo is."""

    __slots__ = ("memo", "text", "bounds", "pieces", "keys", "specials", "lead", "_ids", "_ends", "_chain",
                 "_sub_cut", "_subs")

    def __init__(self, memo: Any, text: str, bounds: list[int], specials: bool,
                 sub_cut: Callable[[str], list[int]] | None = None):
        self.memo, self.text, self.bounds, self.specials = memo, text, bounds, specials
        self.pieces = [text[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
        h = xxhash.xxh3_128_intdigest
        self.keys = [h(p.encode("utf-8", "surrogatepass"), 1 if (i == 0 and specials) else 0)
                     for i, p in enumerate(self.pieces)]
        self._ids: list[np.ndarray | None] = memo._take(self.keys)
        lead = 0
        for f in self._ids:
            if f is None:
                break
            lead += 1
        self.lead = lead
        self._ends: list[int] | None = None
        self._chain: list[int] | None = None
        self._sub_cut = sub_cut
        self._subs: dict[int, tuple[list[int], list[str], list[int], list[np.ndarray | None]]] = {}

    def __len__(self) -> int:
        return len(self.pieces)

    def chars(self, k: int) -> int:
        """Characters in the first ``k`` pieces."""
        return self.bounds[k]

    def ids(self, k: int) -> np.ndarray:
        """The ids of the first ``k`` pieces (``uint32``), encoding those the memo did not hold."""
        found = self._ids
        if any(f is None for f in found[:k]):
            part = found[:k]
            self.memo._fill(self.pieces[:k], self.keys[:k], part, self.specials)
            found[:k] = part
        return found[0] if k == 1 else np.concatenate(found[:k])

    def missing_chars(self, k: int) -> int:
        """Characters of the first ``k`` pieces not encoded yet (what :meth:`ids` would encode)."""
        return sum(len(self.pieces[i]) for i in range(k) if self._ids[i] is None)

    # -- sub-pieces ------------------------------------------------------------------------
    def _sub(self, i: int) -> tuple[list[int], list[str], list[int], list[np.ndarray | None]]:
        """Piece ``i``'s sub-pieces: (bounds in the text, texts, memo keys, ids held or None)."""
        got = self._subs.get(i)
        if got is None:
            piece, start = self.pieces[i], self.bounds[i]
            inner = self._sub_cut(piece) if self._sub_cut is not None and self._ids[i] is None else []
            b = [start, *(start + c for c in inner), self.bounds[i + 1]]
            texts = [piece] if not inner else [self.text[b[t]:b[t + 1]] for t in range(len(b) - 1)]
            h = xxhash.xxh3_128_intdigest
            first = i == 0 and self.specials  # (the text's first sub-piece carries the special tokens)
            keys = [self.keys[i]] if not inner else \
                [h(x.encode("utf-8", "surrogatepass"), 1 if (first and t == 0) else 0) for t, x in enumerate(texts)]
            found = [self._ids[i]] if not inner else self.memo._take(keys)
            got = self._subs[i] = (b, texts, keys, found)
        return got

    def splits(self, i: int) -> int:
        """How many sub-pieces piece ``i`` has (1: it is tokenized whole)."""
        return len(self._sub(i)[1])

    def sub_lead(self, i: int) -> int:
        """How many leading sub-pieces of piece ``i`` the memo holds."""
        n = 0
        for f in self._sub(i)[3]:
            if f is None:
                break
            n += 1
        return n

    def chars_at(self, k: int, j: int = 0) -> int:
        """Characters in the first ``k`` pieces and the first ``j`` sub-pieces of piece ``k``."""
        return self.bounds[k] if j == 0 else self._sub(k)[0][j]

    def missing_chars_at(self, k: int, j: int = 0) -> int:
        """What :meth:`ids_at` would encode, in characters."""
        n = self.missing_chars(k)
        if j:
            _, texts, _, found = self._sub(k)
            n += sum(len(texts[t]) for t in range(j) if found[t] is None)
        return n

    def ids_at(self, k: int, j: int = 0) -> np.ndarray:
        """The ids of the first ``k`` pieces and the first ``j`` sub-pieces of piece ``k``: a prefix
        of the whole text's ids, as :meth:`ids`. All of piece ``k``'s sub-pieces make the piece,
        which is then kept in the memo as one."""
        if j == 0:
            return self.ids(k)
        _, texts, keys, found = self._sub(k)
        if len(texts) == 1:  # (no inner cut: the piece whole)
            return self.ids(k + 1)
        if any(f is None for f in found[:j]):
            part = found[:j]
            self.memo._fill(texts[:j], keys[:j], part, k == 0 and self.specials)
            found[:j] = part
        if j >= len(texts) and self._ids[k] is None:
            whole = np.concatenate(found)
            self._ids[k] = whole
            self.memo.put(self.keys[k], whole, len(self.pieces[k]))
            self._ends = None
            return self.ids(k + 1)
        if not k:
            return found[0] if j == 1 else np.concatenate(found[:j])
        if any(f is None for f in self._ids[:k]):
            self.ids(k)  # (encodes the pieces before it that the memo did not hold)
        return np.concatenate(self._ids[:k] + found[:j])  # one copy: the pieces' ids, then the sub-pieces'

    def tokens_through(self, i: int) -> int:
        """How many ids the first ``i + 1`` pieces have (those pieces already encoded)."""
        if self._ends is None or len(self._ends) <= i:
            ends, n = [], 0
            for f in self._ids:
                if f is None:
                    break
                n += len(f)
                ends.append(n)
            self._ends = ends
        return self._ends[i]

    def chain(self, i: int) -> int:
        """A key of the text's first ``i + 1`` pieces (equal for equal text up to there)."""
        c = self._chain
        if c is None:
            h = xxhash.xxh3_64_intdigest
            c, prev = [], 0
            for k in self.keys:
                prev = h(k.to_bytes(16, "little"), prev)
                c.append(prev)
            self._chain = c
        return c[i]


def load_config(file: Path) -> dict[str, Any]:
    with open(file, encoding="utf-8") as f:
        return json.load(f)


_SAMPLE = ("The quick brown fox jumps over the lazy dog 1234 times; naive cafe, 'quoted' text and "
           "x = f(y) + 3.14 -- newline\nindented  twice   spaced words, CamelCase and snake_case ids. ")


def self_check(encode: Callable[[str, bool], Sequence[int]],
               encode_batch: Callable[[list[str], bool], list[list[int]]]) -> bool:
    """Whether a sample text encoded piece by piece with ``encode_batch`` (small pieces, many
    cuts) gives the ids ``encode`` gives the whole text, with and without special tokens."""
    text = _SAMPLE * 8
    probe = PieceMemo(encode_batch, piece=37, max_chars=1 << 16)
    for specials in (True, False):
        joined = probe.encode(text, specials)
        if joined is None or joined.tolist() != list(encode(text, specials)):
            return False
    return True
