"""Prompt -> token ids, the same way the engines do it, for exact prefix matching.

Every request goes through :func:`simulator.tokenizer.request_to_ids`, the one function the
simulated engine and the indexer use too, which follows vLLM's OpenAI server (BOS added to
completion prompts, chat templates rendered once with transformers' jinja settings and no
special tokens added after them).

Which tokenizer (the ``tokenizer`` setting):

* ``auto`` (default): per served model, the model's own ``tokenizer.json`` when one is on this
  machine (the model name is a local directory, or a Hugging Face hub cache holds it), read with
  the Rust ``tokenizers`` library; otherwise the toy ``SimpleTokenizer``, and the log says so once
  per model.
* a path to a ``tokenizer.json`` (or its directory): that tokenizer for every model.
* ``simple``: the toy tokenizer (the simulator's default).
* null: no tokenization; the router routes without prefix information.

Long prompts are encoded from memoized pieces, so the shared part of prompts (a system prompt, a
document, a conversation's earlier turns) is tokenized once: by the toy tokenizer always, by a
``tokenizer.json`` where its configuration keeps the ids of pieces joined equal to the whole
text's (:mod:`simulator.piece_memo`; the log line naming the tokenizer says which).

Where a ``tokenizer.json`` converts to it (``tokenizer_fast``, :mod:`simulator.fast_bpe`), the
ids are computed by tiktoken's BPE instead of ``tokenizers``': the same ids for a quarter to a
sixth of the CPU, checked against ``tokenizers`` on a sample when the file is loaded.

With ``auto``, a model's tokenizer is found and loaded on a thread (:meth:`PromptEncoder.load`)
as soon as the router knows a backend serving it, or when the first request for it comes: the
event loop keeps serving meanwhile.

``encode`` returns ``None`` when the prompt cannot be tokenized, in which case the router routes
without prefix information rather than failing the request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulator.tokenizer import (
    SimpleTokenizer,
    Tokenizer,
    load_tokenizer,
    request_to_ids,
)

log = logging.getLogger(__name__)
MAX_MODELS = 64  # model names whose tokenizer is looked up and kept


def _hub_dirs() -> list[Path]:
    out = []
    if os.environ.get("HF_HUB_CACHE"):
        out.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]) / "hub")
    out.append(Path.home() / ".cache" / "huggingface" / "hub")
    return out


def find_model_tokenizer(model: str) -> Path | None:
    """A local ``tokenizer.json`` for a served model name, or ``None``: the name as a directory
    (``vllm serve /models/qwen3``), else the Hugging Face hub cache (``models--org--name``,
    the ``main`` snapshot first)."""
    if not model:
        return None
    try:
        return _find(model)
    except (OSError, ValueError, RuntimeError):  # a name no file system accepts (too long, NUL, ~nobody)
        return None


def _find(model: str) -> Path | None:
    p = Path(model).expanduser()
    for cand in (p / "tokenizer.json", p):
        if cand.name == "tokenizer.json" and cand.is_file():
            return cand
    repo = "models--" + model.replace("/", "--")
    for hub in _hub_dirs():
        snaps = hub / repo / "snapshots"
        if not snaps.is_dir():
            continue
        ref = hub / repo / "refs" / "main"
        if ref.is_file():
            cand = snaps / ref.read_text().strip() / "tokenizer.json"
            if cand.is_file():
                return cand
        for snap in sorted(snaps.iterdir()):
            if (snap / "tokenizer.json").is_file():
                return snap / "tokenizer.json"
    return None


def _log_loaded(what: str, tok: Tokenizer) -> None:
    if isinstance(tok, SimpleTokenizer):
        return
    off = getattr(tok, "pieces_off", None)
    fast = getattr(tok, "fast_off", None)
    log.info("router tokenizer %s (%s; %s)", what,
             "long prompts from memoized pieces" if off is None else f"whole prompts: {off}",
             "encoded by tiktoken's BPE" if fast is None else f"encoded by tokenizers: {fast}")


class PromptEncoder:
    def __init__(self, spec: str | None = "auto", vocab_size: int = 32_000, fast: bool = True):
        self.spec = spec
        self.vocab_size = vocab_size
        self.fast = fast  # tiktoken's BPE where a tokenizer.json converts to it (simulator.fast_bpe)
        self._tok: Tokenizer | None = None
        self._per_model: dict[str | tuple[str, str], Tokenizer] = {}
        self._by_file: dict[Path, Tokenizer] = {}
        self._overflow: Tokenizer | None = None
        self._loading: dict[Any, asyncio.Future] = {}
        self._load_lock = threading.Lock()
        if spec is not None and spec != "auto":
            self._tok = load_tokenizer(spec, vocab_size, fast=fast)
            _log_loaded(str(spec), self._tok)
            if isinstance(self._tok, SimpleTokenizer):
                log.warning("router tokenizer: the toy SimpleTokenizer (tokenizer: simple); prefix matches "
                            "are exact only against engines that use it too (the simulator)")

    @property
    def enabled(self) -> bool:
        return self.spec is not None

    def _key(self, model: Any, base: str | None) -> str | tuple[str, str]:
        name = model if isinstance(model, str) else ""
        return (name, base) if base else name

    def ready(self, model: Any, base: str | None = None) -> bool:
        """Whether :meth:`tokenizer_for` answers for ``model`` without reading a file."""
        if self._tok is not None or self.spec is None:
            return True
        return self._key(model, base) in self._per_model or len(self._per_model) >= MAX_MODELS

    def loading(self, model: Any, base: str | None = None) -> bool:
        """Whether :meth:`load` is reading ``model``'s tokenizer now."""
        return self._key(model, base) in self._loading

    async def load(self, model: Any, base: str | None = None) -> None:
        """Find and load ``model``'s tokenizer on a thread, so the event loop goes on serving other
        requests meanwhile: reading and checking a large tokenizer.json takes up to a second or two,
        and until then every request on the loop would wait. Requests for the same model wait for
        the one load."""
        if self.ready(model, base):
            return
        key = self._key(model, base)
        fut = self._loading.get(key)
        if fut is None:
            fut = self._loading[key] = asyncio.get_running_loop().run_in_executor(
                None, self._load_locked, model, base)
            fut.add_done_callback(lambda _f: self._loading.pop(key, None))
        try:
            await asyncio.shield(fut)
        except Exception:  # noqa: BLE001 - tokenizer_for logs its own failures; the caller goes on without
            log.exception("router tokenizer for model %r: loading failed", model)

    def _load_locked(self, model: Any, base: str | None) -> Tokenizer | None:
        with self._load_lock:  # (one file read at a time: two models may share one tokenizer.json)
            return self.tokenizer_for(model, base)

    def tokenizer_for(self, model: Any, base: str | None = None) -> Tokenizer | None:
        """The tokenizer of a served model name. ``base``: the base model when ``model`` names a LoRA
        adapter; as vLLM, the adapter's own ``tokenizer.json`` when one is on this machine, else the
        base model's."""
        if self._tok is not None or self.spec is None:
            return self._tok
        name = model if isinstance(model, str) else ""
        key = self._key(model, base)
        tok = self._per_model.get(key)
        if tok is None and len(self._per_model) >= MAX_MODELS:
            # bounded: names past the first MAX_MODELS (unknown models, clients' typos) share the toy tokenizer
            if self._overflow is None:
                self._overflow = SimpleTokenizer(self.vocab_size)
            return self._overflow
        if tok is None:
            path = find_model_tokenizer(name)
            if path is None and base:  # an adapter without a tokenizer of its own: its base model's
                tok = self.tokenizer_for(base)
            elif path is not None:
                try:
                    real = path.resolve()
                    tok = self._by_file.get(real)  # model names sharing one file share its tokenizer (and memo)
                    if tok is None:
                        tok = self._by_file[real] = load_tokenizer(str(path), fast=self.fast)
                    _log_loaded(f"for model {name!r}: {path}", tok)
                except Exception as exc:  # noqa: BLE001 - a broken file: say so, fall back
                    log.warning("router tokenizer for model %r: cannot read %s (%s)", name, path, exc)
            if tok is None:
                log.warning("router tokenizer for model %r: no tokenizer.json on this machine, using the toy "
                            "SimpleTokenizer (prefix matches hold only against engines that use it too); "
                            "set router.tokenizer to the model's tokenizer.json", name)
                tok = SimpleTokenizer(self.vocab_size)
            self._per_model[key] = tok
        return tok

    def encode(self, kind: str, body: dict[str, Any], *, as_array: bool = False,
               base: str | None = None) -> Sequence[int] | None:
        """Prompt token ids of an OpenAI request (``kind`` "chat" or "completions"), or ``None``.
        ``as_array``: a ``uint32`` numpy array when the tokenizer gives one, for the routing path
        that only hashes them; a list otherwise. ``base``: the base model when the body's model is a
        LoRA adapter (see :meth:`tokenizer_for`)."""
        tok = self.tokenizer_for(body.get("model"), base)
        if tok is None:
            return None
        return self.encode_with(tok, kind, body, as_array=as_array)

    @staticmethod
    def encode_with(tok: Tokenizer, kind: str, body: dict[str, Any], as_array: bool = True) -> Sequence[int] | None:
        """:meth:`encode` with the tokenizer already chosen (:meth:`tokenizer_for`): what the router
        runs on a tokenizer thread, safe there for a tokenizer whose ``releases_gil`` is true."""
        try:
            return request_to_ids(tok, kind, body, as_array=as_array)
        except (ValueError, KeyError, TypeError):
            return None

    def encode_text(self, model: Any, text: str, base: str | None = None) -> list[int] | None:
        """Ids of a piece of text inside a prompt (no special tokens), e.g. generated text."""
        tok = self.tokenizer_for(model, base)
        if tok is None:
            return None
        try:
            return tok.encode(text, add_special_tokens=False)
        except (ValueError, TypeError):
            return None
