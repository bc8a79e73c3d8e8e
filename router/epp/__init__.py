"""The Gateway API Inference Extension endpoint picker (EPP): Envoy asks over ext_proc (gRPC)
where each request goes; the answer comes from the HTTP router's own strategy pipeline, state and
KV index (``infernex router --epp-port N`` serves both side by side).

Owns: the ext_proc protocol (``protocol``: header and metadata names, message builders), the
servicer and gRPC server (``service``), and llm-d's P/D decode-side sidecar (``sidecar``), which
runs the two stages when the picker names a prefill pod in ``x-prefiller-host-port``.

May import: :mod:`router` (core, state, server types), the ``xds-protos`` Envoy bindings, grpcio.
"""

from router.epp.service import EndpointPicker, EppServer, start_epp

__all__ = ["EndpointPicker", "EppServer", "start_epp"]
