"""JetStream topology and pure folds: the state InferNex derives from its streams.

Owns: stream definitions (:mod:`streams.topology`) and folds such as the KV index,
load state, health state and time windows. A fold has ``apply(event)``, queries and
``dump()``; time comes from an injected :class:`streams.clock.Clock`.

May import: the standard library, :mod:`schemas`, and pure computation libraries
(xxhash, numpy, msgspec). Never a broker, HTTP, database or socket library, and no
``await``: consumers decode, apply and ack; folds only compute. ``tests/test_boundaries.py``
enforces this.
"""
