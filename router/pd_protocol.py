"""How the router talks PD (prefill/decode disaggregation) to each KV connector.

A PD request is two requests: a prefill on a producer engine, then the real request on a consumer
engine that pulls the prompt's KV. What each stage must carry depends on the engines' KV connector,
and a field missing makes a real engine fail the request or silently prefill again. Facts, as the
upstream proxies send them:

``nixl`` - vLLM's NixlConnector / P2P flow (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``):
    prefill: ``kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false,
    remote_engine_id/remote_block_ids/remote_host/remote_port: null}``, ``stream: false``,
    ``max_tokens: 1`` (and ``max_completion_tokens: 1`` when present), no ``stream_options``,
    ``min_tokens`` / ``min_completion_tokens`` removed (vLLM refuses ``min_tokens > max_tokens``).
    decode: the client's request with the ``kv_transfer_params`` the prefill answered.

``mooncake`` - upstream vLLM's MooncakeConnector (``examples/online_serving/disaggregated_serving/
mooncake_connector/mooncake_connector_proxy.py``): the proxy makes a ``transfer_id``
(``xfer-<request id>``) and sends it on both requests; prefill ``{do_remote_decode: true,
do_remote_prefill: false, transfer_id}``; decode ``{do_remote_decode: false, do_remote_prefill: true,
transfer_id, remote_bootstrap_addr: "http://<prefill host>:<bootstrap port>", remote_engine_id:
<the prefill engine's id (per data-parallel rank)>}``; the prefill's answer carries nothing the
decode needs. ``X-data-parallel-rank`` names the prefill rank.

``mooncake_ascend`` - vllm-ascend's MooncakeConnectorV1 and its load-balance proxy
(``examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py``): prefill like ``nixl``
but ``min_tokens: 1``; decode gets the prefill's ``kv_transfer_params``; a decode answer whose
``stop_reason`` is ``"recomputed"`` is re-issued (prompt + text so far, ``max_tokens`` reduced) on
a fresh prefill/decode pair.

Pure functions of the request; the HTTP server (:mod:`router.server`) calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

Connector = Literal["nixl", "mooncake", "mooncake_ascend"]
RECOMPUTED = "recomputed"


class PdConnectorConfig(BaseModel):
    """The ``router.pd`` settings: which connector the PD engines run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connector: Connector = "nixl"
    bootstrap_port: int | None = Field(
        default=8998, ge=1, le=65535,
        description="mooncake: the prefill engines' bootstrap port (VLLM_MOONCAKE_BOOTSTRAP_PORT); "
                    "null: the engine's HTTP port (the simulator serves it there)")
    max_recomputes: int = Field(default=3, ge=0, description="'recomputed' decode answers re-issued per request")


@dataclass(frozen=True, slots=True)
class PrefillPeer:
    """What the decode stage must know about the prefill engine."""

    url: str  # the engine's HTTP base URL
    engine_id: str  # its KV connector engine id (one per data-parallel rank)
    dp_rank: int | None = None


class PdProtocol:
    def __init__(self, cfg: PdConnectorConfig | None = None):
        self.cfg = cfg or PdConnectorConfig()

    @property
    def connector(self) -> str:
        return self.cfg.connector

    @property
    def retries_recomputed(self) -> bool:
        return self.cfg.max_recomputes > 0

    def transfer_id(self, request_id: str) -> str:
        return f"xfer-{request_id}"

    def prefill_body(self, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """The stage-one request: a copy of ``body``, never the client's dict itself."""
        pre = dict(body)
        conn = self.cfg.connector
        if conn == "mooncake":
            kvp: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False,
                                   "transfer_id": self.transfer_id(request_id)}
        else:
            kvp = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}
        pre["kv_transfer_params"] = kvp
        pre["stream"] = False
        pre["max_tokens"] = 1
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        pre.pop("stream_options", None)
        if conn == "mooncake_ascend":
            pre["min_tokens"] = 1
            pre.pop("min_completion_tokens", None)
        else:
            pre.pop("min_tokens", None)
            pre.pop("min_completion_tokens", None)
        return pre

    def prefill_headers(self, peer: PrefillPeer) -> dict[str, str]:
        if self.cfg.connector == "mooncake" and peer.dp_rank is not None:
            return {"X-data-parallel-rank": str(peer.dp_rank)}
        return {}

    def decode_params(self, answered: dict[str, Any] | None, peer: PrefillPeer, request_id: str) -> dict[str, Any]:
        """The decode stage's ``kv_transfer_params`` (raises ``ValueError`` when the prefill gave none
        where the connector needs them: a decode without them would silently prefill again)."""
        if self.cfg.connector == "mooncake":
            u = urlsplit(peer.url)
            port = self.cfg.bootstrap_port or u.port or (443 if u.scheme == "https" else 80)
            host = u.hostname or ""
            if ":" in host:
                host = f"[{host}]"
            return {"do_remote_decode": False, "do_remote_prefill": True,
                    "transfer_id": self.transfer_id(request_id),
                    "remote_bootstrap_addr": f"http://{host}:{port}", "remote_engine_id": peer.engine_id}
        if not answered or not answered.get("do_remote_prefill"):
            raise ValueError("the prefill answer carries no kv_transfer_params")
        return dict(answered)


def stop_reason_recomputed(choice: Any) -> bool:
    return isinstance(choice, dict) and choice.get("stop_reason") == RECOMPUTED
