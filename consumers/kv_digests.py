"""Block digests in place of token ids, for the bus (the KV bridge's Python path; no I/O).

The index keys a block by chaining per-block digests of its token ids
(:func:`streams.kv_core.block_digests`, then ``combine``), so a bridge can send each block's
digest (8 bytes) instead of its ids (4 bytes per token: 64 for a 16-token block). The bus, the
stream's store and every consumer then carry about a quarter of the bytes.
:mod:`consumers.kv_transcode` writes the same digests in its compiled path; this module does it
for the batches the Python decoder makes.

The digests need the index's compiled core (numba): :func:`available` says whether this install
has it. Without it a bridge sends token ids, which every consumer also reads.
"""

from __future__ import annotations

import sys

import numpy as np

from schemas import kv_binary

try:
    from streams.kv_core import block_digests as _block_digests
except ImportError:  # the base install, without numba
    _block_digests = None

_LITTLE = sys.byteorder == "little"


def available() -> bool:
    return _block_digests is not None and _LITTLE


def with_digests(events: list) -> list:
    """``events`` (wire structs, :func:`schemas.kv_binary.to_wire`'s) with every store whose
    token ids cover its blocks exactly carrying their digests instead. A store that does not fit
    (already keyed or digested, or ids that do not match its blocks) stays as it is, so the
    consumer refuses or takes it as it would have."""
    out = []
    for e in events:
        if type(e) is kv_binary.WStored and e.block_keys is None and e.block_digests is None:
            hb, tb = memoryview(e.block_hashes).nbytes, memoryview(e.token_ids).nbytes
            n, bs = hb // 8, e.block_size
            if n and bs > 0 and hb % 8 == 0 and tb == 4 * n * bs:
                toks = np.frombuffer(e.token_ids, dtype="<u4")
                e = kv_binary.WStored(e.block_hashes, b"", bs, e.parent_block_hash, e.lora_id, e.lora_name, e.medium,
                                      e.block_salts, e.parent_key, None,
                                      _block_digests(toks, bs, n).astype("<u8", copy=False).tobytes())
        out.append(e)
    return out


def warm_up() -> bool:
    """Compile (or load from numba's cache) the digest kernel as :func:`with_digests` calls it, now:
    a bridge reaches this path only on the frames its transcoder leaves (other shapes of vLLM's
    events), and the first one would compile it for seconds on a fresh install. False without it."""
    if not available():
        return False
    one = kv_binary.WStored(memoryview((7).to_bytes(8, "little")), memoryview(bytes(8)), 2, None, None, None, None,
                            None, None, None, None)
    with_digests([one])
    return True

