"""vLLM's prefix-cache block hashing (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``).

* ``sha256`` (vLLM's default ``--prefix-caching-hash-algo``): ``sha256(pickle.dumps(x,
  protocol=HIGHEST_PROTOCOL))``; ``sha256_cbor``: ``sha256(cbor2.dumps(x, canonical=True))``.
* A full block's hash is ``hash_fn((parent_hash or NONE_HASH, tuple(block_tokens), extra_keys))``;
  only full blocks are hashed, the trailing partial block never is.
* ``NONE_HASH = hash_fn(seed)`` where the seed is ``$PYTHONHASHSEED`` if set, else the fixed
  ``"vllm-none-hash"`` (current vLLM, cryptographic algorithms). Older vLLM drew random
  bytes when ``PYTHONHASHSEED`` was unset; pass an explicit ``seed`` to reproduce a
  deployment that set it. This module never reads the environment itself.
* KV events carry the low 64 bits of the digest, read big-endian
  (``maybe_convert_block_hash``).

``xxhash`` and ``xxhash_cbor`` (XXH3-128 over the pickle or the canonical CBOR of the same
tuple, vLLM's non-cryptographic options) are offered for speed; vLLM gives them a random
``NONE_HASH`` unless a seed is set, here the seed is the same.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash as _xxhash

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_U64 = (1 << 64) - 1

HashFn = Callable[[Any], bytes]


def sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_pickle128(obj: Any) -> bytes:
    return _xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor128(obj: Any) -> bytes:
    return _xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


def hash_fn_by_name(name: str) -> HashFn:
    if name == "sha256":
        return sha256
    if name == "sha256_cbor":
        return sha256_cbor
    if name == "xxhash":
        return xxhash_pickle128
    if name == "xxhash_cbor":
        return xxhash_cbor128
    raise ValueError(f"unknown prefix-caching hash algorithm {name!r}; choose one of {', '.join(HASH_ALGOS)}")


def none_hash(hash_fn: HashFn, seed: str | None = None) -> bytes:
    """The chain's root: ``hash_fn(seed)``, seed defaulting to ``"vllm-none-hash"``."""
    return hash_fn(DEFAULT_NONE_HASH_SEED if seed is None else seed)


def to_external(block_hash: bytes) -> int:
    """The value KV events carry: the digest's low 64 bits, big-endian."""
    return int.from_bytes(block_hash, "big") & _U64


EXTRA_KEY_STYLES = ("0.11", "0.22", "0.33")


def block_extra_keys(start: int, end: int, *, lora_name: str | None = None, lora_path: str | None = None,
                     mm: Sequence[tuple[str, int, int]] = (), cache_salt: str | None = None,
                     style: str = "0.33") -> tuple | None:
    """The extra keys vLLM mixes into the hash of the block of tokens ``[start, end)``
    (``generate_block_hash_extra_keys``): the LoRA adapter, the multimodal items the block
    overlaps (``mm``: ``(identifier, offset, length)`` sorted by offset) and, on the first
    block, the ``cache_salt``, in that order. vLLM 0.33 tags each (``("lora", name, path)``,
    ``("mm", id, offset_in_block)``, ``("cache_salt", s)``); 0.22 uses the bare name,
    ``(id, offset_in_block)`` and the bare salt; 0.11 the bare name, id and salt."""
    if style not in EXTRA_KEY_STYLES:
        raise ValueError(f"unknown extra-key style {style!r}; choose one of {', '.join(EXTRA_KEY_STYLES)}")
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path) if style == "0.33" else lora_name)
    for ident, offset, length in mm:
        if end <= offset:
            break
        if start > offset + length or (style != "0.11" and start == offset + length):
            continue  # the block is past this item
        if style == "0.33":
            keys.append(("mm", ident, offset - start))
        elif style == "0.22":
            keys.append((ident, offset - start))
        else:
            keys.append(ident)
        if end < offset + length:
            break  # the item goes on past this block
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt) if style == "0.33" else cache_salt)
    return tuple(keys) if keys else None


def request_extra_keys(num_tokens: int, block_size: int, **kwargs: Any) -> list[tuple | None]:
    """:func:`block_extra_keys` of every full block of a ``num_tokens`` prompt."""
    return [block_extra_keys(i * block_size, (i + 1) * block_size, **kwargs) for i in range(num_tokens // block_size)]


def event_extra_keys(keys: Sequence[tuple | None], style: str = "0.33") -> list | None:
    """The per-block ``extra_keys`` a ``BlockStored`` event publishes. vLLM 0.33 removes its
    tags (``to_event_extra_keys``: bare LoRA name and salt, ``(id, offset)`` for mm items);
    0.22 publishes the hash keys as they are; None when there are none."""
    if not keys:
        return None
    if style != "0.33":
        return list(keys)
    return [None if k is None else tuple(x[1:] if x[0] == "mm" else x[1] for x in k) for k in keys]


class BlockHasher:
    """Hashes token sequences into chained full-block hashes, as vLLM's scheduler does."""

    __slots__ = ("block_size", "algo", "hash_fn", "none_hash", "style", "_memo", "_memo_size")

    def __init__(self, block_size: int = 16, algo: str = "sha256", seed: str | None = None,
                 memo_size: int = 262_144, style: str = "0.33"):
        """``memo_size`` > 0 remembers that many recent block hashes (shared prefixes are
        hashed once; the digests are identical either way). ``style`` is the vLLM release
        whose extra keys ``cache_salt`` follows (:func:`block_extra_keys`)."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if style not in EXTRA_KEY_STYLES:
            raise ValueError(f"unknown extra-key style {style!r}; choose one of {', '.join(EXTRA_KEY_STYLES)}")
        self.style = style
        self.block_size = block_size
        self.algo = algo
        self.hash_fn = hash_fn_by_name(algo)
        self.none_hash = none_hash(self.hash_fn, seed)
        self._memo: dict[tuple, bytes] | None = {} if memo_size > 0 else None
        self._memo_size = memo_size

    def _hash(self, key: tuple) -> bytes:
        memo = self._memo
        if memo is None:
            return self.hash_fn(key)
        h = memo.get(key)
        if h is None:
            h = self.hash_fn(key)
            if len(memo) >= self._memo_size:
                memo.clear()
            memo[key] = h
        return h

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple | None = None) -> bytes:
        return self._hash((self.none_hash if parent is None else parent, tuple(tokens), extra_keys))

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        parent: bytes | None = None,
        *,
        start_block: int = 0,
        cache_salt: str | None = None,
        extra_keys: Sequence[tuple | None] | None = None,
    ) -> list[bytes]:
        """Hashes of every FULL block of ``token_ids`` from block ``start_block`` on.

        ``parent`` is the hash of block ``start_block - 1`` (``None`` at the start). As in
        vLLM, ``cache_salt`` is an extra key of the first block only (tagged in 0.33, see
        ``style``); ``extra_keys`` gives one entry per block (indexed from block 0, e.g. from
        :func:`request_extra_keys`) and wins over ``cache_salt``.
        """
        bs = self.block_size
        fn = self._hash
        prev = self.none_hash if parent is None else parent
        out: list[bytes] = []
        n_full = len(token_ids) // bs
        tokens = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
        for i in range(start_block, n_full):
            if extra_keys is not None and i < len(extra_keys):
                extra = extra_keys[i]
            elif cache_salt is not None and i == 0:
                extra = self.salt_key(cache_salt)
            else:
                extra = None
            prev = fn((prev, tuple(tokens[i * bs:(i + 1) * bs]), extra))
            out.append(prev)
        return out

    def salt_key(self, cache_salt: str | None) -> tuple | None:
        """The extra keys of a request's first block carrying only ``cache_salt``."""
        return block_extra_keys(0, self.block_size, cache_salt=cache_salt, style=self.style)

    def external_hashes(self, token_ids: Sequence[int], **kwargs: Any) -> list[int]:
        """The 64-bit hashes a KV event would carry for ``token_ids``' full blocks."""
        return [to_external(h) for h in self.hash_blocks(token_ids, **kwargs)]
