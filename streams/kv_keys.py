"""What besides tokens decides whether an engine can reuse a block: pure helpers.

vLLM's block hash covers the parent hash, the block's tokens and the block's *extra keys*: the
multimodal inputs it overlaps, the LoRA adapter (by name) and, on the first block, the
request's ``cache_salt``. Our index keys blocks by its own chained hash over tokens; these
helpers turn the extra keys into a 64-bit salt mixed into a block's chain seed, and the LoRA
adapter into the seed of a prompt's first block, so the index shares a key exactly where vLLM
would share a block.
"""

from __future__ import annotations

from typing import Any

import msgspec
from xxhash import xxh3_64_intdigest

_enc = msgspec.msgpack.Encoder()

#: the version of the index's block-key function (``streams.kv_core``): 2 chains per-block digests
#: of the tokens into the parent key (since the bridges send digests); 1 chained the tokens directly.
#: Keys made under another version name other blocks: recorded keys (decision records'
#: ``inputs.prefix_keys``) are only compared with an index built under the same one. Bump it, and
#: ``consumers.index_codec.SNAPSHOT_FORMAT``, whenever the key function changes.
KEY_SCHEME = 2


def lora_seed(lora: int | str | None = None) -> int:
    """The chain seed of a prompt's first block: 0, or derived from the LoRA adapter."""
    if lora is None:
        return 0
    return xxh3_64_intdigest(f"lora:{lora}".encode())


def extra_salt(extra: Any, lora_name: str | None = None) -> int:
    """The salt of one block from its vLLM ``extra_keys`` entry (None or a tuple/list).

    The LoRA name is left out (the chain seed already carries it). 0 means "no salt".
    """
    if not extra:
        return 0
    items = list(extra)
    if lora_name is not None and lora_name in items:
        items.remove(lora_name)
    if not items:
        return 0
    try:
        data = _enc.encode(items)
    except (TypeError, msgspec.EncodeError):
        data = repr(items).encode()
    return xxh3_64_intdigest(b"extra:" + data) or 1


def request_salt(cache_salt: str | None) -> int:
    """The salt of a request's first block when it carries ``cache_salt`` (no multimodal input)."""
    return 0 if not cache_salt else extra_salt([cache_salt])
