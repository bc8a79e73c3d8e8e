"""Tokenizing a long text prompt only as far as an engine may hold it.

A prefix match needs the prompt's tokens only up to where the engines' caches stop matching it;
past that, nothing can match, and tokenizing new text (a fresh question after a shared document,
the latest turn of a conversation) is most of what a request costs the router with a real
tokenizer (bench/RESULTS.md, sessions 14-15). So a long prompt is cut into the tokenizer's memo
pieces (:class:`simulator.piece_memo.PiecePlan`) and tokenized from the front:

1. the leading pieces the memo holds (a lookup each), the first piece it does not hold, and every
   further piece of text this router recently sent somewhere untokenized (see 3), whose blocks
   then count as predicted on that engine. Without such routes the first piece not held is
   tokenized in sub-pieces of about a quarter piece, as in 2: it usually starts with text an
   engine holds (a shared document's end, memoized as sub-pieces when an earlier prompt had it)
   and ends in new text (the question), so only the sub-piece where the text parts is encoded;
2. then, while some engine holds (or is predicted to hold) every block tokenized so far, more
   pieces: one, then two, four... (so a cache that reaches further is matched exactly: after a
   router restart the index knows blocks the memo never saw);
3. where it stops, the pieces left untokenized are remembered (:class:`PieceRoutes`, by a key of
   the text up to each piece) with the engine the request went to, for the route predictions'
   time to live. A later prompt with the same text there tokenizes it (1) and counts those blocks
   as predicted on that engine, as if the first request had tokenized them: a burst of requests
   sharing a new document still goes to one engine. A route ends :data:`SETTLE_S` after its
   request does (:meth:`PieceRoutes.settle`; on the other router replicas, which got it, too:
   :mod:`router.replica_sync`): the engine has computed the text by then, its KV
   events say what it holds, and a route kept for its whole time to live would count blocks the
   engine has evicted since as predicted there again.

Each engine's match on the blocks its KV events reported is then exactly what the whole
prompt's tokens would give: it ends inside the tokenized part, or the whole prompt was
tokenized. Predicted blocks from an earlier route of the same text count as far as that route's
whole pieces (a whole-prompt prediction could reach up to one piece further, into the text where
the two prompts part). What else differs: ``prompt_tokens`` is estimated for the untokenized rest
(from the tokenized part's characters per token), decision records carry the block keys of the
tokenized part, and the other router replicas get the untokenized text's piece keys
(``RoutedPrompt.pieces``) besides the block keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from typing import Any

MAX_PIECE_ROUTES = 1 << 18  # remembered pieces (least recently added first out): ~40 MB at most
#: how long a route stands after its request ended: the engine's last KV events on their way to the
#: index (bench/ingest_path.py measures a lag p99 of 5-20 ms from the engine's socket to the index)
SETTLE_S = 2.0


class PieceRoutes:
    """(model, key of the text through a piece) -> (engine, expiry) for text routed untokenized."""

    def __init__(self, ttl_s: float, max_entries: int = MAX_PIECE_ROUTES):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._d: OrderedDict[tuple[str, int], tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def add(self, model: str, chains: Sequence[int], pod: str, now: float) -> None:
        d = self._d
        exp = now + self.ttl_s
        for c in chains:
            k = (model, c)
            d.pop(k, None)
            d[k] = (pod, exp)
        while len(d) > self.max_entries:
            d.popitem(last=False)

    def settle(self, model: str, chains: Sequence[int], pod: str, until: float) -> None:
        """The request that sent this text to ``pod`` is over: its routes there end at ``until``
        (a route of the same text to another engine since is left alone)."""
        d = self._d
        for c in chains:
            k = (model, c)
            v = d.get(k)
            if v is not None and v[0] == pod and v[1] > until:
                d[k] = (pod, until)  # (an existing key keeps its place in the order)

    def get(self, model: str, chain: int, now: float) -> str | None:
        v = self._d.get((model, chain))
        if v is None:
            return None
        if v[1] <= now:
            del self._d[(model, chain)]
            return None
        return v[0]


def first_pieces(plan: Any, routes: PieceRoutes, model: str, now: float) -> tuple[int, dict[str, int]]:
    """How many leading pieces to tokenize first, and per engine the last of them it was sent
    untokenized (step 1 of the module's description)."""
    n = len(plan)
    k = min(plan.lead + 1, n)
    routed: dict[str, int] = {}
    # (the pieces the memo holds were tokenized by a request that looked up their routes then: the
    # engines it found there count them as predicted blocks already)
    i = plan.lead
    while i < n:
        pod = routes.get(model, plan.chain(i), now) if len(routes) else None
        if pod is not None:
            routed[pod] = i
        elif i >= k:
            break
        i += 1
    return max(k, i), routed


def lazy_steps(plan: Any, routes: PieceRoutes, model: str, now: float, block_size: int, *,
               keys_of: Callable[[Any], Any], matched: Callable[[Any], int],
               materialize: Callable[[str, Any], None]) -> Generator[tuple[int, int], Any, tuple[Any, Any, int, int]]:
    """Steps 1 and 2 of the module's description as a generator: it yields how far it needs the
    ids, ``(k, j)``: the first ``k`` pieces and the first ``j`` sub-pieces of piece ``k``
    (``PiecePlan.ids_at``), and is sent those ids (:func:`run` encodes them on the spot, the
    router's async path on a tokenizer thread); returns (ids, their block keys, whole pieces
    covered, characters covered). ``keys_of(ids)``: the ids' block keys; ``matched(keys)``: the
    most leading blocks any engine holds or is predicted to hold; ``materialize(pod, keys)``:
    count ``keys`` as predicted there.

    The first piece the memo does not hold is tokenized sub-piece by sub-piece, as the pieces
    after it (the first one not held, then while some engine holds every block so far one, two,
    four... more): its sub-pieces of text an earlier prompt had are held, and the one where this
    prompt's text is new usually ends the walk."""
    n = len(plan)
    k, routed = first_pieces(plan, routes, model, now)
    if not routed and k == plan.lead + 1 and plan.splits(plan.lead) > 1:
        i, subs = plan.lead, plan.splits(plan.lead)
        j = min(subs, plan.sub_lead(i) + 1)
        step = 1
        while True:
            ids = yield (i, j)
            keys = keys_of(ids)
            if j >= subs:
                break  # the whole piece: on piece by piece
            if not (len(keys) and matched(keys) >= len(keys)):
                return ids, keys, i, plan.chars_at(i, j)
            j = min(subs, j + step)
            step *= 2
    else:
        ids = yield (k, 0)
        keys = keys_of(ids)
        for pod, i in routed.items():
            materialize(pod, keys[: plan.tokens_through(i) // block_size])
    step = 1
    while k < n and len(keys) and matched(keys) >= len(keys):
        k = min(n, k + step)
        step *= 2
        ids = yield (k, 0)
        keys = keys_of(ids)
    return ids, keys, k, plan.chars(k)


def run(steps: Generator[tuple[int, int], Any, tuple[Any, Any, int, int]], plan: Any) -> tuple[Any, Any, int, int]:
    """:func:`lazy_steps` driven here, each step's ids encoded on the spot."""
    at = next(steps)
    while True:
        try:
            at = steps.send(plan.ids_at(*at))
        except StopIteration as done:
            return done.value


def estimate_tokens(plan: Any, done: int, n_ids: int) -> int:
    """Prompt tokens: ``n_ids`` for the first ``done`` characters, the rest at their characters per token."""
    rest = len(plan.text) - done
    return n_ids + (round(rest * n_ids / done) if rest > 0 and done > 0 else 0)
