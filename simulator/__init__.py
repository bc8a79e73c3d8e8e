"""Simulated vLLM engines and NPU/GPU devices, for local runs and tests.

Owns: an engine that speaks vLLM's OpenAI server, ``/metrics`` and ZMQ KV-event
interfaces exactly (so the real bridges work against it unchanged), its paged KV cache
with vLLM's block hashing, a continuous-batching timing model, PD roles, fault
injection, and device telemetry in npu-smi / npu-exporter / DCGM formats.

Modules: ``kv_events`` (vLLM's KV-event structs and msgpack codecs), ``kv_publisher`` (ZMQ
PUB + replay ROUTER in vLLM's wire format), ``hashing`` (vLLM's block hashes), ``tokenizer``,
``config`` (hardware/model profiles, engine and section settings), ``engine_core`` (the pure,
virtual-time engine model), ``server`` (the OpenAI/metrics HTTP server around one core),
``cluster`` (several engines on one loop, ``SimCluster`` for tests and the demo).

May import: :mod:`schemas` and libraries (zmq, msgspec, aiohttp, prometheus_client, tokenizers).
Never :mod:`consumers`, :mod:`router` or :mod:`infernex`: the simulator stands where a
real engine stands.
"""
