"""Pluggable tokenizers for the simulated engine.

* :class:`SimpleTokenizer`: deterministic and dependency-free. Words and punctuation become
  ids by a stable hash (same text, same ids, in every process); ids decode to synthetic
  syllable words that encode back to the same id, so generated text round-trips.
* :class:`HFTokenizer`: a Hugging Face ``tokenizer.json`` read from a local path with the
  ``tokenizers`` library (no downloads); its chat template is used when a
  ``tokenizer_config.json`` beside it has one and ``jinja2`` is installed, else the simple one.

:func:`prompt_to_ids` turns the OpenAI ``prompt`` forms (text, list of ints,
``prompt_token_ids``) into token ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import xxhash

Message = dict[str, Any]


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[Message]) -> str: ...


def _message_text(content: Any) -> str:
    """OpenAI content: a string or a list of parts (``{"type": "text", "text": ...}``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                raise ValueError("only text content parts are supported")
        return "".join(parts)
    raise ValueError("message content must be a string or a list of text parts")


def simple_chat_template(messages: Sequence[Message]) -> str:
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError("each message needs a role")
        out.append(f"<|{m['role']}|>\n{_message_text(m.get('content'))}\n")
    out.append("<|assistant|>\n")
    return "".join(out)


_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70 syllables
_SYL_INDEX = {s: i for i, s in enumerate(_SYLLABLES)}
_WORD_RE = re.compile(r"\w+|[^\w\s]")


class SimpleTokenizer:
    """Deterministic word/punctuation tokenizer with a configurable vocabulary size."""

    RESERVED = 16  # ids below this are never produced from text

    def __init__(self, vocab_size: int = 32_000):
        if vocab_size <= self.RESERVED * 2:
            raise ValueError(f"vocab_size must be greater than {self.RESERVED * 2}")
        self.vocab_size = vocab_size
        self._span = vocab_size - self.RESERVED

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
        parsed = self._parse(word)
        if parsed is not None:
            return parsed
        return self.RESERVED + xxhash.xxh64_intdigest(word.encode()) % self._span

    def encode(self, text: str) -> list[int]:
        return [self.token_for_word(w) for w in _WORD_RE.findall(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self._syllables(i - self.RESERVED) if i >= self.RESERVED else f"<{i}>" for i in ids)

    def apply_chat_template(self, messages: Sequence[Message]) -> str:
        return simple_chat_template(messages)


class HFTokenizer:
    """A Hugging Face fast tokenizer from a local ``tokenizer.json`` (file or its directory)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _HF

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tok = _HF.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size()
        self._template = None
        cfg = file.parent / "tokenizer_config.json"
        if cfg.is_file():
            try:
                tmpl = json.loads(cfg.read_text()).get("chat_template")
            except ValueError:
                tmpl = None
            if isinstance(tmpl, str):
                try:
                    import jinja2

                    self._template = jinja2.Environment().from_string(tmpl)
                except ImportError:
                    self._template = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def apply_chat_template(self, messages: Sequence[Message]) -> str:
        if self._template is not None:
            return self._template.render(messages=list(messages), add_generation_prompt=True)
        return simple_chat_template(messages)


def load_tokenizer(spec: str | None, vocab_size: int = 32_000) -> Tokenizer:
    """``None``/``"simple"`` -> :class:`SimpleTokenizer`; anything else is a local path."""
    if spec is None or spec == "simple":
        return SimpleTokenizer(vocab_size)
    return HFTokenizer(spec)


def prompt_to_ids(tokenizer: Tokenizer, prompt: Any = None, prompt_token_ids: Any = None) -> list[int]:
    """Token ids of an OpenAI-style prompt: text, a list of ints, a one-element list of
    either, or an explicit ``prompt_token_ids``. Raises ``ValueError`` on anything else."""
    if prompt_token_ids is not None:
        prompt = prompt_token_ids
    if prompt is None:
        raise ValueError("a prompt is required")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return prompt_to_ids(tokenizer, prompt[0])
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 or t >= tokenizer.vocab_size for t in prompt):
                raise ValueError(f"token ids must be in [0, {tokenizer.vocab_size})")
            return list(prompt)
        raise ValueError("prompt must be a string or a list of token ids (batched prompts are not supported)")
    raise ValueError("prompt must be a string or a list of token ids")
