"""Workloads: Mooncake-format traces, prompt synthesis, synthetic generators, and the
open-loop OpenAI replay client with its metrics.

Owns: :mod:`.trace` (load and validate a trace: ``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids`` of fixed-size blocks), :mod:`.synth` (each hash id becomes
the same deterministic tokens and text everywhere, so shared ids are shared prefixes),
:mod:`.generators` (seeded shared-system-prompt, multi-turn chat and document-QA traces in
the same format), :mod:`.metrics` (per-request rows and the summary: TTFT, ITL, throughput,
hit rate; shared with the what-if simulator) and :mod:`.client` (async ``replay`` over plain
OpenAI HTTP, so it can drive any router).

May import: the standard library, msgspec, pydantic, numpy, httpx (client only) and
:mod:`simulator.tokenizer`. Never :mod:`consumers`, :mod:`router` or :mod:`infernex`.
"""

from simulator.workloads.trace import TraceFormatError, TraceIssue, TraceRow, iter_trace, load_trace, write_trace

__all__ = ["TraceFormatError", "TraceIssue", "TraceRow", "iter_trace", "load_trace", "write_trace"]
