"""Prompt -> token ids, the same way the engines do it, for exact prefix matching.

Uses the simulator's tokenizers (``simple`` or a local Hugging Face ``tokenizer.json``, chat
template applied for chat requests). Returns ``None`` when the prompt cannot be tokenized, in
which case the router routes without prefix information rather than failing the request.
"""

from __future__ import annotations

from typing import Any


class PromptEncoder:
    def __init__(self, spec: str | None = "simple", vocab_size: int = 32_000):
        self.spec = spec
        self._tok = None
        if spec is not None:
            from simulator.tokenizer import load_tokenizer

            self._tok = load_tokenizer(spec, vocab_size)

    @property
    def enabled(self) -> bool:
        return self._tok is not None

    def encode(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        tok = self._tok
        if tok is None:
            return None
        from simulator.tokenizer import prompt_to_ids

        try:
            if kind == "chat":
                return tok.encode(tok.apply_chat_template(body["messages"]))
            return prompt_to_ids(tok, body.get("prompt"), body.get("prompt_token_ids"))
        except (ValueError, KeyError, TypeError):
            return None
