"""Simulated vLLM engines and NPU/GPU devices, for local runs and tests.

Owns: an engine that speaks vLLM's OpenAI server, ``/metrics`` and ZMQ KV-event
interfaces exactly (so the real bridges work against it unchanged), its paged KV cache
with vLLM's block hashing, a continuous-batching timing model, PD roles, fault
injection, and device telemetry in npu-smi / npu-exporter / DCGM formats.

May import: :mod:`schemas` and libraries (zmq, msgspec, starlette/uvicorn, tokenizers).
Never :mod:`consumers`, :mod:`router` or :mod:`infernex`: the simulator stands where a
real engine stands.
"""
