"""A byte-level BPE ``tokenizer.json`` encoded by tiktoken's Rust BPE instead of ``tokenizers``.

With the model's ``tokenizer.json``, the router spends most of a long prompt's CPU in
``tokenizers``' pre-tokenizer (its Oniguruma regex: about 0.2 us per character, bench/RESULTS.md
session 16); tiktoken splits and merges the same text four to six times faster. The two compute
the same ids when the tokenizer is byte-level BPE with one regex split (GPT-2's built-in pattern,
or one ``Split`` before a regex-less ``ByteLevel``, as Llama 3 and Qwen write theirs) and the
merge list is in the vocabulary's id order: tiktoken merges the adjacent pair whose joined bytes
have the lowest id, ``tokenizers`` the pair listed first, and the two orders agree there.
:func:`refusal` checks those conditions on the file; what it accepts is still compared with
``tokenizers`` on a sample at load (:func:`load`), and a tokenizer that fails either is used
through ``tokenizers`` as before.

What is not proven: for a vocabulary with one merge per token (one trained by ``tokenizers``, as
GPT-2's), a pair whose joined bytes are a token by another merge could be merged by tiktoken and
not by ``tokenizers``. :func:`load` refuses a vocabulary where a token's own bytes show it (the
BPE does not make that token of them); a pair met only inside longer words is left to the sample
check, and no such text was found on the real tokenizers we test (tests/test_fast_bpe.py).
Unicode tables may differ between the two regex engines and Python's ``unicodedata`` (for
NFC/NFKC) for characters assigned in recent Unicode versions.

Added tokens (``<|begin_of_text|>`` and the like) are split out of the text first, longest first,
as ``tokenizers`` does; the post-processor's own tokens (BOS) are read off ``tokenizers`` itself.
"""

from __future__ import annotations

import json
import random
import re
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# ``tokenizers``' ByteLevel pre-tokenizer with use_regex (GPT-2's split)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_of_char() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (GPT-2's table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _normalizer(norm: Any) -> tuple[str | None, str | None]:
    """(the unicodedata form to apply or None, why not convertible or None)."""
    if norm is None:
        return None, None
    kind = norm.get("type")
    if kind == "Sequence" and not norm.get("normalizers"):
        return None, None
    if kind in ("NFC", "NFKC"):
        return kind, None
    return None, f"normalizer {kind!r}"


def _pattern(pre: Any) -> tuple[str | None, str | None]:
    """(the split regex, why not convertible)."""
    if not isinstance(pre, dict):
        return None, "no pre-tokenizer"
    if pre.get("type") == "ByteLevel":
        if not pre.get("use_regex", True) or pre.get("add_prefix_space"):
            return None, "ByteLevel without its regex, or with a prefix space"
        return GPT2_PATTERN, None
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not parts or len(parts) != 2:
        return None, f"pre-tokenizer {pre.get('type')!r} (one regex split and ByteLevel convert)"
    split, level = parts
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert") \
            or "Regex" not in (split.get("pattern") or {}):
        return None, "the pre-tokenizer's first step is not an isolating regex split"
    if level.get("type") != "ByteLevel" or level.get("use_regex", True) or level.get("add_prefix_space"):
        return None, "the pre-tokenizer's second step is not ByteLevel without a regex"
    return split["pattern"]["Regex"], None


def refusal(config: dict[str, Any]) -> str | None:
    """None when this ``tokenizer.json`` content converts to tiktoken's BPE; else why not."""
    return _shape_refusal(config) or _ranks(config)[1]


def _shape_refusal(config: dict[str, Any]) -> str | None:
    """:func:`refusal` but for the vocabulary and merges."""
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return f"model {model.get('type')!r}"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        if model.get(key):
            return f"BPE {key}"
    _, why = _normalizer(config.get("normalizer"))
    if why:
        return why
    _, why = _pattern(config.get("pre_tokenizer"))
    if why:
        return why
    norm = _normalizer(config.get("normalizer"))[0] is not None  # (an empty sequence normalizes nothing)
    for tok in config.get("added_tokens") or []:
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
            return f"added token {tok.get('content')!r} strips or matches single words"
        if tok.get("normalized") and norm:
            return f"added token {tok.get('content')!r} is matched on normalized text"
    return None


def _ranks(config: dict[str, Any]) -> tuple[dict[bytes, int], str | None]:
    """The vocabulary as tiktoken's ranks (token bytes -> id), or why it cannot be."""
    model = config["model"]
    vocab: dict[str, int] = model.get("vocab") or {}
    added = {t["id"] for t in config.get("added_tokens") or []}
    dec = byte_of_char()
    ranks: dict[bytes, int] = {}
    for tok, i in vocab.items():
        if i in added:
            continue
        try:
            b = bytes(dec[c] for c in tok)
        except KeyError:
            return {}, f"vocabulary entry {tok!r} is not byte-level"
        if b in ranks:
            return {}, f"two vocabulary entries for the bytes {b!r}"
        ranks[b] = i
    if sum(1 for b in ranks if len(b) == 1) != 256:
        return {}, "the vocabulary lacks some of the 256 bytes"
    made: set[str] = set()
    last = -1
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        i = vocab.get(a + b)
        if i is None:
            return {}, f"merge {a!r} {b!r} makes no vocabulary entry"
        if i < last or i <= vocab.get(a, -1) or i <= vocab.get(b, -1):
            return {}, "the merges are not in the vocabulary's id order"
        last = i
        made.add(a + b)
    for tok, i in vocab.items():
        if i not in added and len(tok) > 1 and tok not in made:
            return {}, f"vocabulary entry {tok!r} is made by no merge"
    return ranks, None


def _self_made(config: dict[str, Any], hf: Any) -> str | None:
    """Why not, when some token is not what ``tokenizers``' BPE makes of its own bytes: tiktoken
    takes a pre-token that is a whole token as that token, ``tokenizers`` (unless the model says
    ``ignore_merges``) merges it, and the two then differ on text with that word."""
    model = config["model"]
    if model.get("ignore_merges"):
        return None
    added = {t["id"] for t in config.get("added_tokens") or []}
    bpe = hf.model
    for tok, i in (model.get("vocab") or {}).items():
        if len(tok) > 1 and i not in added:
            got = bpe.tokenize(tok)
            if len(got) != 1 or got[0].id != i:
                return f"tokenizers' BPE does not make the token {tok!r} of its own bytes"
    return None


def _affixes(hf: Any) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a text (BOS...), read off ``tokenizers``
    on two probes; None when they are not one fixed prefix and suffix."""
    got = set()
    for probe in ("a b", "Hello, world 12."):
        with_ = hf.encode(probe, add_special_tokens=True).ids
        bare = hf.encode(probe, add_special_tokens=False).ids
        for i in range(len(with_) - len(bare) + 1):
            if with_[i:i + len(bare)] == bare:
                got.add((tuple(with_[:i]), tuple(with_[i + len(bare):])))
                break
        else:
            return None
    if len(got) != 1:
        return None
    pre, post = got.pop()
    return list(pre), list(post)


class FastBPE:
    """Encodes as the ``tokenizers`` tokenizer the config and ranks come from (see :func:`load`)."""

    def __init__(self, config: dict[str, Any], ranks: dict[bytes, int], affixes: tuple[list[int], list[int]]):
        import tiktoken

        pattern, _ = _pattern(config.get("pre_tokenizer"))
        self._form, _ = _normalizer(config.get("normalizer"))
        self._enc = tiktoken.Encoding("infernex-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        self._prefix, self._suffix = affixes
        self._added = {t["content"]: t["id"] for t in config.get("added_tokens") or [] if t.get("content")}
        # leftmost, then longest, as tokenizers' matcher; a text with none of the heads skips the regex
        self._added_rx = re.compile("|".join(re.escape(s) for s in sorted(self._added, key=len, reverse=True))) \
            if self._added else None
        self._heads = sorted({s[:2] for s in self._added})

    def _ordinary(self, text: str) -> np.ndarray:
        if not text.isascii():
            text.encode("utf-8")  # lone surrogates raise here (tiktoken would replace them)
            if self._form is not None:
                text = unicodedata.normalize(self._form, text)
        # (encode_ordinary and then an array: encode_to_numpy takes tiktoken's slower special-token path)
        return np.array(self._enc.encode_ordinary(text), dtype=np.uint32)

    def encode_array(self, text: str, add_special_tokens: bool) -> np.ndarray:
        """``text``'s ids as ``uint32``; raises UnicodeEncodeError on text that is not valid
        Unicode (lone surrogates: the caller encodes it with ``tokenizers``)."""
        parts: list[Any] = [self._prefix] if add_special_tokens and self._prefix else []
        rx = self._added_rx
        if rx is not None and any(h in text for h in self._heads):
            at = 0
            for m in rx.finditer(text):
                if m.start() > at:
                    parts.append(self._ordinary(text[at:m.start()]))
                parts.append([self._added[m.group()]])
                at = m.end()
            if at < len(text):
                parts.append(self._ordinary(text[at:]))
        else:
            parts.append(self._ordinary(text))
        if add_special_tokens and self._suffix:
            parts.append(self._suffix)
        if len(parts) == 1 and isinstance(parts[0], np.ndarray):
            return parts[0]
        return np.concatenate([np.asarray(p, dtype=np.uint32) for p in parts])  # (never empty: the text's part)


_SAMPLE = ("The quick brown fox jumps over the lazy dog 1234567 times; it's, we'll, they'RE \"quoted\"\n\n"
           "  indented\tand\r\ntabbed  x = f(y) + 3.14e-2 -- CamelCase snake_case __dunder__ <a href='#'>\n"
           "naïve café ﬁne Ⅻ ① ２０２６年 中文字符 日本語のテキスト 한국어 Ελληνικά русский عربى हिन्दी "
           "emoji 🙂👍🏽 👩‍💻 e\u0301 \u00a0nbsp\u2009thin\u3000wide\x0bvt\x0cff\x85nel trailing   \n"
           # characters no letter, number, punctuation or space class takes: a split regex that
           # leaves them out loses them in tiktoken and keeps them in tokenizers
           "\x00nul\x07\x1b[0m \u200bzw\u200dj\ufeffbom \ue000pua \u2028ls\u2029ps 𝔘𝔫𝔦 \u0301mark \U000e0041tag\n")


def sample_texts(added: Sequence[str] = (), n: int = 120, seed: int = 7) -> list[str]:
    """Texts the two encoders are compared on: the sample above, its slices, random strings over
    its characters, and the added tokens placed inside text."""
    rnd = random.Random(seed)
    alphabet = sorted(set(_SAMPLE))
    out = [_SAMPLE, _SAMPLE * 3, "", " ", "\n\n", "  a", "a  "]
    for i in range(n):
        a = rnd.randrange(len(_SAMPLE))
        out.append(_SAMPLE[a:a + rnd.randrange(1, 200)])
        out.append("".join(rnd.choice(alphabet) for _ in range(rnd.randrange(1, 120))))
    for s in list(added)[:50]:
        out.append(f"x{s}y {s}{s} z{s}")
    return out


def agrees(fast: Callable[[str, bool], np.ndarray], whole: Callable[[str, bool], Sequence[int]],
           texts: Sequence[str]) -> str | None:
    """None when ``fast`` and ``whole`` give the same ids on every text, with and without special
    tokens; else the first text that differs."""
    for t in texts:
        for specials in (False, True):
            if fast(t, specials).tolist() != list(whole(t, specials)):
                return t
    return None


def load(file: Path, hf: Any) -> tuple[FastBPE | None, str | None]:
    """(the fast encoder for the ``tokenizers`` tokenizer ``hf`` read from ``file``, None) or
    (None, why it is not used)."""
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return None, "tiktoken is not installed"
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        return None, f"cannot read {file.name}: {exc}"
    why = _shape_refusal(config)
    if why:
        return None, why
    ranks, why = _ranks(config)
    if why:
        return None, why
    why = _self_made(config, hf)
    if why:
        return None, why
    affixes = _affixes(hf)
    if affixes is None:
        return None, "the post-processor's special tokens are not a fixed prefix and suffix"
    fast = FastBPE(config, ranks, affixes)
    bad = agrees(fast.encode_array, lambda t, s: hf.encode(t, add_special_tokens=s).ids,
                 sample_texts(list(fast._added)))
    if bad is not None:
        return None, f"tiktoken's ids differ from tokenizers' on {bad[:40]!r}"
    return fast, None
