"""hermes-router: the OpenAI-compatible HTTP router.

Owns: the HTTP API, strategy plugins (filters, scorers, pickers, profiles), the PD
two-stage proxy, backend discovery, resilience (retries, migration, circuit breakers,
drain) and the request records it publishes.

May import: :mod:`schemas`, :mod:`streams` (it embeds folds such as the KV index and
load state) and :mod:`consumers.bus` for publishing and subscribing. Strategy plugins
are pure: they read state snapshots passed in and never do I/O.
"""
