"""``infernex router --epp-port``: the real command serves the endpoint picker beside the HTTP API
(gRPC health SERVING, a pick over ext_proc), and stops on Ctrl-C."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from proctools import stop_process
from test_epp_protocol import body_msgs, chat, converse, headers_msg, set_headers

from router.epp import protocol as P
from router.epp.envoy import free_port


async def test_router_cli_serves_the_picker():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "infernex.cli", "router", "--no-bus", "--port", "0",
                             "--epp-port", str(port), "--profile", "kv-aware",
                             "-b", "p0=http://10.9.0.1:8000@m", "-b", "p1=http://10.9.0.2:8000@m"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            h = health_pb2_grpc.HealthStub(ch)
            status = None
            for _ in range(150):
                try:
                    r = await h.Check(health_pb2.HealthCheckRequest(service=P.SERVICE), timeout=1)
                    status = r.status
                    break
                except grpc.aio.AioRpcError:
                    assert proc.poll() is None, proc.stdout.read().decode()
                    await asyncio.sleep(0.2)
            assert status == health_pb2.HealthCheckResponse.SERVING
            from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

            out = await converse(pb_grpc.ExternalProcessorStub(ch),
                                 [headers_msg(), *body_msgs(chat())])
            assert set_headers(out[0].request_headers.response)[P.DESTINATION] in {"10.9.0.1:8000", "10.9.0.2:8000"}
    finally:
        text = stop_process(proc)
    assert f"epp=grpc://127.0.0.1:{port}" in text and proc.returncode == 0
