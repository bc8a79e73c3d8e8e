"""Tokenizers, chat templates and the one request -> token ids function, as vLLM's OpenAI server.

* :func:`request_to_ids` is the single place where an OpenAI request body becomes prompt token
  ids. The simulated engine, the router and the indexer all call it, so the block keys they
  compute agree. It follows vLLM's OpenAI server (``serving_completion`` / ``serving_chat`` /
  ``chat_utils``):

  - ``/v1/completions``: a text prompt is tokenized **with** special tokens (BOS), vLLM's
    ``add_special_tokens=True`` default for completion requests; a prompt given as token ids is
    used as it is.
  - ``/v1/chat/completions``: the chat template is rendered **once**, then tokenized **without**
    adding special tokens again (vLLM's chat default ``add_special_tokens=False``: the template
    writes its own BOS). ``add_generation_prompt`` (default true), ``continue_final_message``,
    ``chat_template_kwargs``, ``tools`` and the request's ``add_special_tokens`` are honoured.
    Text content parts are joined with ``"\\n"`` (vLLM's "string" content format) unless the
    template loops over ``message['content']`` ("openai" format: parts passed as they are).

* :class:`HFTokenizer`: a Hugging Face ``tokenizer.json`` (the Rust ``tokenizers`` library, no
  downloads); its post-processor adds BOS as the model's tokenizer does. The chat template comes
  from ``chat_template.jinja`` or ``tokenizer_config.json`` beside it and is rendered with the
  jinja settings transformers uses: sandboxed, ``trim_blocks``, ``lstrip_blocks``, the loop
  controls extension, a no-op ``{% generation %}`` tag, ``tojson`` without ASCII escaping,
  ``raise_exception`` and ``strftime_now``; the variables are ``messages``, ``tools``,
  ``documents``, ``add_generation_prompt``, the special tokens (``bos_token``, ``eos_token``, ...)
  and the request's ``chat_template_kwargs``.
* :class:`SimpleTokenizer`: deterministic and dependency-free, for when no model tokenizer
  exists. Words and punctuation become ids by a stable hash; ids decode to synthetic syllable
  words that encode back to the same id. Text is cut at whitespace into chunks whose ids are
  memoized, so prompts that share a prefix (multi-turn chat, shared documents) cost only their
  new part; the work is linear in the prompt.

A rendered chat is returned as :class:`RenderedChat` (a ``str``), so a caller that only calls
``encode(text)`` still does not add special tokens to it a second time.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import xxhash

Message = dict[str, Any]


class RenderedChat(str):
    """A prompt rendered by a chat template: its special tokens are already written in it."""

    __slots__ = ()


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[Message], **kwargs: Any) -> str: ...


def _wants_specials(text: str, add_special_tokens: bool | None) -> bool:
    """vLLM/HF default: add special tokens to plain text, never to a rendered chat."""
    if add_special_tokens is None:
        return not isinstance(text, RenderedChat)
    return bool(add_special_tokens)


# ---------------------------------------------------------------- messages as vLLM parses them

def _content_parts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and "text" in part:
                texts.append(str(part["text"]))
            else:
                raise ValueError("only text content parts are supported")
        return texts
    raise ValueError("message content must be a string or a list of text parts")


def _message_text(content: Any) -> str:
    """OpenAI content as vLLM's "string" format gives it to a template: text parts joined by newlines."""
    return "\n".join(_content_parts(content))


def conversation(messages: Any, content_format: str = "string") -> list[Message]:
    """The messages handed to a chat template: each a copy with ``content`` normalised to a string
    ("string" format) or a list of ``{"type": "text", "text": ...}`` ("openai" format)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message needs a role")
        texts = _content_parts(m.get("content"))
        msg = dict(m)
        if content_format == "openai":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        out.append(msg)
    return out


def _final_text(message: Message) -> str:
    c = message.get("content")
    if isinstance(c, list):
        for part in reversed(c):
            if isinstance(part, dict) and "text" in part:
                return str(part["text"])
        raise ValueError("continue_final_message: the final message has no text")
    return "" if c is None else str(c)


def _continue_final(rendered: str, messages: Sequence[Message]) -> str:
    """transformers' ``continue_final_message``: cut the rendering right after the final message's
    text, so the model continues it instead of opening a new turn."""
    final = _final_text(messages[-1]).strip()
    idx = rendered.rfind(final)
    if idx < 0:
        raise ValueError("continue_final_message is set but the final message does not appear in the rendered chat")
    return rendered[: idx + len(final)]


def simple_chat_template(messages: Sequence[Message], add_generation_prompt: bool = True,
                         continue_final_message: bool = False) -> str:
    out = []
    for m in conversation(list(messages)):
        out.append(f"<|{m['role']}|>\n{m['content']}\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    text = "".join(out)
    return _continue_final(text, messages) if continue_final_message else text


# ---------------------------------------------------------------- jinja as transformers sets it up

def _jinja_env():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content)")


def detect_content_format(template: str) -> str:
    """"openai" when the template iterates over a message's content parts, else "string" (vLLM's
    ``auto`` content format, approximated by looking for a loop over ``<msg>['content']``)."""
    return "openai" if _CONTENT_LOOP.search(template) else "string"


class ChatTemplate:
    """A chat template compiled once; :meth:`render` runs it once per request."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any] | None = None,
                 tool_source: str | None = None):
        env = _jinja_env()
        self.source = source
        self._tmpl = env.from_string(source)
        self._tool_tmpl = env.from_string(tool_source) if tool_source else None
        self.special_tokens = dict(special_tokens or {})
        self.content_format = detect_content_format(source)

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Any = None, documents: Any = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> RenderedChat:
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        conv = conversation(list(messages), self.content_format)
        tmpl = self._tool_tmpl if (tools and self._tool_tmpl is not None) else self._tmpl
        variables = {**self.special_tokens, **dict(chat_template_kwargs or {})}
        variables.update(messages=conv, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt)
        try:
            text = tmpl.render(**variables)
        except Exception as exc:  # noqa: BLE001 - jinja errors (raise_exception, bad data) are input errors
            raise ValueError(f"chat template: {exc}") from None
        if continue_final_message:
            text = _continue_final(text, conv)
        return RenderedChat(text)


def _token_text(v: Any) -> Any:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        return v.get("content")
    if isinstance(v, list):
        return [_token_text(x) for x in v]
    return v


_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                 "additional_special_tokens")


def load_chat_template(directory: Path) -> ChatTemplate | None:
    """The chat template beside a tokenizer: ``chat_template.jinja`` first (transformers saves it
    there), else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
    templates: "default", and "tool_use" for requests with tools)."""
    cfg: dict[str, Any] = {}
    cfg_file = directory / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{cfg_file}: not JSON ({exc})") from None
    specials = {k: _token_text(cfg[k]) for k in _SPECIAL_KEYS if cfg.get(k) is not None}
    source, tool_source = None, None
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    else:
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, str):
            source = tmpl
        elif isinstance(tmpl, list):
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            source = named.get("default")
            tool_source = named.get("tool_use")
            if source is None and tool_source is not None:
                source, tool_source = tool_source, None
    if source is None:
        return None
    return ChatTemplate(source, specials, tool_source)


# ---------------------------------------------------------------- the toy tokenizer

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70 syllables
_SYL_INDEX = {s: i for i, s in enumerate(_SYLLABLES)}
_WORD_RE = re.compile(r"\w+|[^\w\s]")
_NON_WORD = re.compile(r"[^\w\s]")  # a piece without any of these splits at whitespace exactly as _WORD_RE does
_CHUNK = 256  # characters per memoized piece (cut at the next whitespace)
# the compiled path: long text is cut at the next space after every _PIECE characters and each
# piece's ids are memoized (a prompt sharing a prefix with an earlier one, as every turn of a
# conversation does, runs the kernel over the rest only), up to _PIECE_MEMO_CHARS of text
_PIECE = 2048
_PIECE_MEMO_CHARS = 16 << 20


def _cut(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of at least ``size`` characters (the last may be shorter), each cut just
    before a space: no token spans whitespace, so the pieces' ids joined are the text's ids."""
    n = len(text)
    start = 0
    find = text.find
    while start < n:
        cut = find(" ", start + size)
        if cut < 0:
            cut = n
        yield text[start:cut]
        start = cut


@functools.cache
def _ascii_kernel():
    """:mod:`simulator.tokenizer_kernel` when numba is installed (the router's extra), else None."""
    try:
        from simulator import tokenizer_kernel
    except ImportError:
        return None
    return tokenizer_kernel


@functools.cache
def _syllable_table():
    return _ascii_kernel().syllable_table(_SYLLABLES)


def warm_up() -> None:
    """Compile (or load from numba's cache) the toy tokenizer's kernel when numba is there, so the
    first long prompt does not pay it (about 1.5 s cold, 0.3 s from the cache)."""
    if _ascii_kernel() is not None:
        SimpleTokenizer().encode("bada " * (_CHUNK // 4))
        SimpleTokenizer().encode_array("bada " * (_CHUNK // 4))  # (the router's uint32 specialization)
        SimpleTokenizer().encode_array("bada " * (_PIECE // 2))  # (long text: memoized pieces)


class SimpleTokenizer:
    """Deterministic word/punctuation tokenizer with a configurable vocabulary size.

    No special tokens: ``add_special_tokens`` changes nothing. A token never spans whitespace,
    so the text is cut at whitespace into ~256-character pieces tokenized on their own and
    memoized (least recently used evicted first); a prompt sharing a prefix with an earlier one re-tokenizes only the rest.
    With numba installed (the router's extra), ASCII text longer than a piece is tokenized by a
    compiled kernel instead (:mod:`simulator.tokenizer_kernel`, the same ids, about 3.5x less CPU on
    the trace's prompts: bench/tokenizer_trace.py), in memoized 2k-character pieces when it is long.
    """

    RESERVED = 16  # ids below this are never produced from text
    releases_gil = False  # its kernels and memo run under the GIL: tokenize it on the event loop

    def __init__(self, vocab_size: int = 32_000, memo_pieces: int = 65_536):
        if vocab_size <= self.RESERVED * 2:
            raise ValueError(f"vocab_size must be greater than {self.RESERVED * 2}")
        self.vocab_size = vocab_size
        self._span = vocab_size - self.RESERVED
        self._memo: dict[str, list[int]] = {}
        self._memo_max = memo_pieces
        self._words: dict[str, int] = {}
        # the compiled path's memo: piece hash -> (uint32 ids, characters), least recently used first
        self._pieces: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self._pieces_chars = 0
        self._pieces_max = _PIECE_MEMO_CHARS

    @staticmethod
    def _syllables(n: int) -> str:
        base = len(_SYLLABLES)
        parts = []
        while True:
            n, r = divmod(n, base)
            parts.append(_SYLLABLES[r])
            if n == 0:
                break
        return "".join(reversed(parts))

    def _parse(self, word: str) -> int | None:
        if len(word) % 2 or not word.isalpha() or not word.islower():
            return None
        n = 0
        for i in range(0, len(word), 2):
            idx = _SYL_INDEX.get(word[i:i + 2])
            if idx is None:
                return None
            n = n * len(_SYLLABLES) + idx
        if len(word) > 2 and word[:2] == _SYLLABLES[0]:
            return None  # leading zero syllable: not a canonical synthetic word
        tid = n + self.RESERVED
        return tid if tid < self.vocab_size else None

    def token_for_word(self, word: str) -> int:
        tid = self._words.get(word)
        if tid is None:
            tid = self._parse(word)
            if tid is None:
                tid = self.RESERVED + xxhash.xxh64_intdigest(word.encode()) % self._span
            if len(self._words) >= 1 << 18:
                self._words.clear()
            self._words[word] = tid
        return tid

    def _encode_piece(self, piece: str) -> list[int]:
        memo = self._memo
        ids = memo.pop(piece, None)
        if ids is not None:
            memo[piece] = ids  # most recently used last: eviction takes the oldest first
            return ids
        # words only (the usual text): str.split is several times cheaper than the regex
        ws = _WORD_RE.findall(piece) if _NON_WORD.search(piece) else piece.split()
        ids = list(map(self._words.get, ws))
        if None in ids:  # words not seen before
            tfw = self.token_for_word
            ids = [t if t is not None else tfw(w) for t, w in zip(ids, ws)]
        if len(memo) >= self._memo_max:  # bounded: the least recently used quarter goes
            for k in list(islice(memo, max(1, self._memo_max // 4))):
                del memo[k]
        memo[piece] = ids
        return ids

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        n = len(text)
        if n > _CHUNK and text.isascii():
            ids = self._encode_compiled(text)
            if ids is not None:
                return ids.tolist()
        if n <= _CHUNK:
            return list(self._encode_piece(text))
        out: list[int] = []
        for piece in _cut(text, _CHUNK):
            out += self._encode_piece(piece)
        return out

    def _kernel_pass(self, kernel: Any, text: str, dtype: type) -> np.ndarray:
        out = np.empty(len(text), dtype=dtype)
        k = kernel.encode_ascii(np.frombuffer(text.encode("ascii"), dtype=np.uint8), _syllable_table(),
                                len(_SYLLABLES), self.RESERVED, self.vocab_size, out)
        return out[:k]

    def _encode_compiled(self, text: str, dtype: type = np.int64) -> np.ndarray | None:
        """ASCII text through the compiled kernel, or None without numba. Text of two pieces or
        more is cut just before a space after every :data:`_PIECE` characters (no token spans
        whitespace) and each piece's ids are memoized, keyed by a 128-bit hash of its bytes: a
        prompt sharing a prefix with an earlier one takes the pieces it holds from the memo and
        runs the kernel once over the rest, where it also marks the pieces' edges."""
        kernel = _ascii_kernel()
        if kernel is None:
            return None
        n = len(text)
        if n < 2 * _PIECE:
            return self._kernel_pass(kernel, text, dtype)
        b = text.encode("ascii")
        bounds = [0, *_space_cuts(text, _PIECE), n]  # (ASCII: the same offsets in b)
        mv = memoryview(b)
        h = xxhash.xxh3_128_intdigest
        keys = [h(mv[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)]
        memo = self._pieces
        parts = []
        i = 0
        for key in keys:  # the pieces held, from the start (a prompt diverges from an earlier one once)
            held = memo.get(key)
            if held is None:
                break
            memo.move_to_end(key)
            parts.append(held[0])
            i += 1
        if i < len(keys):
            out, marks = self._kernel_marks(kernel, b, bounds[i], bounds[i + 1:-1])
            edges = [0, *marks, len(out)]
            from simulator.piece_memo import keep

            for j in range(i, len(keys)):  # (views of out)
                self._pieces_chars = keep(memo, keys[j], out[edges[j - i]:edges[j - i + 1]], bounds[j + 1] - bounds[j],
                                          self._pieces_chars, self._pieces_max)
            parts.append(out)
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out if dtype is np.uint32 else out.astype(dtype)

    def plan(self, text: str, add_special_tokens: bool | None = None):
        """Long ASCII text as the compiled path's memo pieces, tokenized from the front on demand
        (:class:`simulator.piece_memo.PiecePlan`), or None (short or non-ASCII text, no numba)."""
        if len(text) < 2 * _PIECE or not text.isascii() or _ascii_kernel() is None:
            return None
        from simulator.piece_memo import PiecePlan

        bounds = [0, *_space_cuts(text, _PIECE), len(text)]
        return PiecePlan(_SimplePieces(self), text, bounds, False, _simple_sub_cuts)

    def _kernel_marks(self, kernel: Any, b: bytes, start: int, cuts: list[int]) -> tuple[np.ndarray, list[int]]:
        """Ids of ``b[start:]`` (uint32) and, per offset in ``cuts``, how many come before it."""
        out = np.empty(len(b) - start, dtype=np.uint32)
        marks = np.empty(len(cuts), dtype=np.int64)
        k = kernel.encode_ascii_marks(np.frombuffer(b, dtype=np.uint8), start, _syllable_table(), len(_SYLLABLES),
                                      self.RESERVED, self.vocab_size, out, np.array(cuts, dtype=np.int64), marks)
        return out[:k], marks.tolist()

    def encode_array(self, text: str, add_special_tokens: bool | None = None) -> np.ndarray:
        """:meth:`encode` as a ``uint32`` array (the ids are below :attr:`vocab_size`): what the
        router hashes into block keys, without a Python int per token."""
        if len(text) > _CHUNK and text.isascii():
            ids = self._encode_compiled(text, np.uint32)
            if ids is not None:
                return ids
        return np.array(self.encode(text), dtype=np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self._syllables(i - self.RESERVED) if i >= self.RESERVED else f"<{i}>" for i in ids)

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **_: Any) -> RenderedChat:
        return RenderedChat(simple_chat_template(messages, add_generation_prompt, continue_final_message))


# ---------------------------------------------------------------- Hugging Face tokenizer.json

def _space_cuts(text: str, size: int) -> list[int]:
    """Where :class:`SimpleTokenizer` cuts long text: before the first space at least ``size``
    characters after the last cut (no token spans a space)."""
    out, s = [], 0
    while (c := text.find(" ", s + size)) >= 0:
        out.append(c)
        s = c
    return out


def _simple_sub_cuts(piece: str) -> list[int]:
    """Cuts inside one of its pieces, the same way, every quarter piece."""
    return _space_cuts(piece, _PIECE // 4)


class _SimplePieces:
    """:class:`SimpleTokenizer`'s piece memo as :class:`simulator.piece_memo.PiecePlan` reads it
    (the same keys: a 128-bit hash of each piece's bytes). Not thread-safe, as the tokenizer."""

    def __init__(self, tok: SimpleTokenizer):
        self.tok = tok

    def _take(self, keys: list[int]) -> list[np.ndarray | None]:
        from simulator.piece_memo import take

        return take(self.tok._pieces, keys)

    def _fill(self, pieces: list[str], keys: list[int], found: list[np.ndarray | None], first_special: bool) -> None:
        """One kernel pass from the first piece not found to the last asked for, marking the edges."""
        i = next((j for j, f in enumerate(found) if f is None), None)
        if i is None:
            return
        tok = self.tok
        b = "".join(pieces[i:]).encode("ascii")
        cuts, n = [], 0
        for p in pieces[i:-1]:
            n += len(p)
            cuts.append(n)
        out, marks = tok._kernel_marks(_ascii_kernel(), b, 0, cuts)
        edges = [0, *marks, len(out)]
        for j in range(i, len(pieces)):
            found[j] = out[edges[j - i]:edges[j - i + 1]]
            self.put(keys[j], found[j], len(pieces[j]))

    def put(self, key: int, ids: np.ndarray, chars: int) -> None:
        """Keep ``ids`` (of a piece of ``chars`` characters), the least recently used out past the limit."""
        from simulator.piece_memo import keep

        tok = self.tok
        tok._pieces_chars = keep(tok._pieces, key, ids, chars, tok._pieces_chars, tok._pieces_max)


class HFTokenizer:
    """A Hugging Face fast tokenizer from a local ``tokenizer.json`` (file or its directory).

    Thread-safe, and its encoding runs without the GIL (``tokenizers``' batch encoder releases
    it; its single-text ``encode`` does not, so text is encoded as a batch of one): a router
    tokenizes long prompts on worker threads while its event loop serves other requests."""

    releases_gil = True

    def __init__(self, path: str | Path, fast: bool = False):
        """``fast``: encode with tiktoken's BPE where this tokenizer converts to it with the same
        ids (:mod:`simulator.fast_bpe`; ``fast_off`` says why not otherwise). The router asks for
        it; the simulated engines keep ``tokenizers``, as vLLM does."""
        from tokenizers import Tokenizer as _HF

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.path = file
        self._tok = _HF.from_file(str(file))
        # as transformers calls it for vLLM (no truncation or padding asked): a tokenizer.json's own
        # truncation and padding settings do not apply to a prompt
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._tok.get_vocab_size()
        # the batch encoder without character offsets (tokenizers >= 0.21): the same ids for about
        # 30% less CPU (bench/RESULTS.md, session 14); we never read the offsets
        self._batch = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        self.chat_template = load_chat_template(file.parent)
        self._fast = None
        self.fast_off: str | None = "not asked for"
        if fast:
            from simulator import fast_bpe

            self._fast, self.fast_off = fast_bpe.load(file, self._tok)
        # long text from memoized pieces where the tokenizer's configuration allows it
        # (simulator.piece_memo); ``pieces_off`` says why not otherwise
        from simulator import piece_memo

        self.pieces: piece_memo.PieceMemo | None = None
        try:
            why = piece_memo.piece_safe(piece_memo.load_config(file))
        except (OSError, ValueError) as exc:
            why = f"cannot read {file.name}: {exc}"
        if why is None:
            if piece_memo.self_check(self._hf_whole, self._hf_batch):  # (whether tokenizers' own ids join)
                self.pieces = piece_memo.PieceMemo(self._encode_batch)
            else:
                why = "a sample text encoded in pieces differs from the whole"
        self.pieces_off = why

    def _hf_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [e.ids for e in self._batch(texts, add_special_tokens=add_special_tokens)]

    def _hf_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        # a batch of one: the same ids as encode(), with the GIL released while it runs
        return self._batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _whole_array(self, text: str, add_special_tokens: bool) -> np.ndarray:
        if self._fast is not None:
            try:
                return self._fast.encode_array(text, add_special_tokens)
            except UnicodeEncodeError:  # lone surrogates: tokenizers' own handling
                pass
        return np.array(self._hf_whole(text, add_special_tokens), dtype=np.uint32)

    def _encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[Any]:
        if self._fast is None:
            return self._hf_batch(texts, add_special_tokens)
        return [self._whole_array(t, add_special_tokens) for t in texts]

    def _encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._fast is None:
            return self._hf_whole(text, add_special_tokens)
        return self._whole_array(text, add_special_tokens).tolist()

    def _from_pieces(self, text: str, specials: bool) -> np.ndarray | None:
        if self.pieces is None or len(text) < 2 * self.pieces.piece:
            return None
        return self.pieces.encode(str(text), specials)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        specials = _wants_specials(text, add_special_tokens)
        ids = self._from_pieces(text, specials)
        return ids.tolist() if ids is not None else self._encode_whole(text, specials)

    def plan(self, text: str, add_special_tokens: bool | None = None):
        """Long text as memo pieces to tokenize from the front on demand
        (:class:`simulator.piece_memo.PiecePlan`), or None (short text, or no piece memo)."""
        if self.pieces is None or len(text) < 2 * self.pieces.piece:
            return None
        return self.pieces.plan(str(text), _wants_specials(text, add_special_tokens))

    def encode_array(self, text: str, add_special_tokens: bool | None = None) -> np.ndarray:
        """:meth:`encode` as a ``uint32`` array: what the router hashes into block keys."""
        specials = _wants_specials(text, add_special_tokens)
        ids = self._from_pieces(text, specials)
        return ids if ids is not None else self._whole_array(text, specials)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: Any = None,
                            chat_template_kwargs: Mapping[str, Any] | None = None, **_: Any) -> RenderedChat:
        if self.chat_template is None:
            return RenderedChat(simple_chat_template(messages, add_generation_prompt, continue_final_message))
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tools=tools,
                                         chat_template_kwargs=chat_template_kwargs)


def load_tokenizer(spec: str | None, vocab_size: int = 32_000, fast: bool = False) -> Tokenizer:
    """``None``/``"simple"`` -> :class:`SimpleTokenizer`; anything else is a local path to a
    ``tokenizer.json`` or its directory."""
    if spec is None or spec == "simple":
        return SimpleTokenizer(vocab_size)
    return HFTokenizer(spec, fast=fast)


# ---------------------------------------------------------------- requests -> ids

def _encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool, as_array: bool) -> Any:
    if as_array and hasattr(tokenizer, "encode_array"):
        return tokenizer.encode_array(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def prompt_to_ids(tokenizer: Tokenizer, prompt: Any = None, prompt_token_ids: Any = None,
                  add_special_tokens: bool = True, as_array: bool = False) -> Sequence[int]:
    """Token ids of an OpenAI completions prompt: text (tokenized with special tokens, as vLLM's
    completions default), a list of ints (used as is), a one-element list of either, or an
    explicit ``prompt_token_ids``. Raises ``ValueError`` on anything else. ``as_array``: text
    may come back as a ``uint32`` numpy array (a tokenizer with ``encode_array``)."""
    if prompt_token_ids is not None:
        prompt = prompt_token_ids
    if prompt is None:
        raise ValueError("a prompt is required")
    if isinstance(prompt, str):
        return _encode_text(tokenizer, str(prompt), add_special_tokens, as_array)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return prompt_to_ids(tokenizer, prompt[0], add_special_tokens=add_special_tokens, as_array=as_array)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 or t >= tokenizer.vocab_size for t in prompt):
                raise ValueError(f"token ids must be in [0, {tokenizer.vocab_size})")
            return list(prompt)
        raise ValueError("prompt must be a string or a list of token ids (batched prompts are not supported)")
    raise ValueError("prompt must be a string or a list of token ids")


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"'{key}' must be a boolean")
    return v


def render_chat(tokenizer: Tokenizer, body: Mapping[str, Any]) -> RenderedChat:
    """The chat prompt text of a ``/v1/chat/completions`` body, rendered once."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError("'chat_template_kwargs' must be an object")
    text = tokenizer.apply_chat_template(
        body.get("messages"), add_generation_prompt=_flag(body, "add_generation_prompt", True),
        continue_final_message=_flag(body, "continue_final_message", False), tools=body.get("tools"),
        chat_template_kwargs=kwargs)
    return text if isinstance(text, RenderedChat) else RenderedChat(text)


def request_text(tokenizer: Tokenizer, kind: str, body: Mapping[str, Any]) -> tuple[str, bool] | None:
    """(prompt text, add special tokens) of an OpenAI request whose prompt is text, as
    :func:`request_to_ids` tokenizes it; None when the prompt is token ids (or not one text).
    Raises ``ValueError`` on a body that cannot be rendered."""
    if kind == "chat":
        return render_chat(tokenizer, body), _flag(body, "add_special_tokens", False)
    if body.get("prompt_token_ids") is not None:
        return None
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1:
        p = p[0]
    if not isinstance(p, str):
        return None
    return p, _flag(body, "add_special_tokens", True)


def request_to_ids(tokenizer: Tokenizer, kind: str, body: Mapping[str, Any], as_array: bool = False) -> Sequence[int]:
    """Prompt token ids of an OpenAI request as vLLM's OpenAI server computes them.

    ``kind`` is ``"chat"`` for ``/v1/chat/completions`` (template rendered once, special tokens
    not added again unless the body says ``add_special_tokens: true``) or anything else for
    ``/v1/completions`` (text tokenized with special tokens unless ``add_special_tokens: false``).
    Raises ``ValueError`` on a body that cannot be tokenized. ``as_array``: see :func:`prompt_to_ids`."""
    if kind == "chat":
        text = render_chat(tokenizer, body)
        return _encode_text(tokenizer, text, _flag(body, "add_special_tokens", False), as_array)
    return prompt_to_ids(tokenizer, body.get("prompt"), body.get("prompt_token_ids"),
                         add_special_tokens=_flag(body, "add_special_tokens", True), as_array=as_array)
