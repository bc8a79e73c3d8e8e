"""Wiring: the service with its state, embedded KV index, bus feeds, replica sync, record publisher and
Kubernetes discovery. Used by ``infernex router`` and by tests."""

from __future__ import annotations

import asyncio
import logging
import os

from prometheus_client import CollectorRegistry

from router.config import RouterConfig
from router.server import RouterService
from router.state import ClusterState
from schemas.config import NatsConfig
from streams.clock import Clock, SystemClock

log = logging.getLogger(__name__)


class RouterApp:
    def __init__(self, cfg: RouterConfig, nats: NatsConfig | None = None, *,
                 registry: CollectorRegistry | None = None, clock: Clock | None = None):
        from streams.kv_index import KvIndex
        from streams.kv_spares import PrefaultingSpares

        self.cfg = cfg
        self.nats = nats
        self.registry = registry or CollectorRegistry()
        self.clock = clock or SystemClock()
        self.state = ClusterState(cfg, clock=self.clock)
        self.index = KvIndex(self.clock, default_block_size=cfg.block_size,
                             predict_on_route_ttl_s=cfg.route_prediction_ttl_s, spares=PrefaultingSpares())
        self.nc = None
        self.feeds = None
        self.records = None
        self.kube = None
        self.sync = None  # router.replica_sync.ReplicaSync with the bus and cfg.replica_sync
        self.service: RouterService | None = None
        self.epp = None  # router.epp.EppServer when cfg.epp_port is set

    async def start(self, host: str | None = None, port: int | None = None) -> str:
        from router.feeds import warm_up

        await asyncio.to_thread(warm_up)  # the KV index's and the KV feed's kernels, before the first event or request
        if self.cfg.tokenize_threads and "TOKENIZERS_PARALLELISM" not in os.environ:
            # the router's tokenizer threads run prompts side by side; tokenizers' own thread pool
            # within each prompt then only adds its workers' spinning (about 15% more CPU per
            # request on 7.4k-character prompts: bench/RESULTS.md, session 14). Read per call.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if self.cfg.tokenizer is not None:
            from simulator.tokenizer import warm_up as warm_tokenizer

            await asyncio.to_thread(warm_tokenizer)  # the toy tokenizer's kernel (the fallback tokenizer)
        prefix = self.nats.subject_prefix if self.nats else None
        if self.cfg.bus and self.nats is not None:
            from consumers import bus
            from router.feeds import BusFeeds
            from router.records import BusRecordSink

            # no echo: the replica sync subject is the only one the router both publishes and reads
            self.nc = await bus.connect(self.nats, name="infernex-router", no_echo=True)
            self.feeds = BusFeeds(self.nc, self.state, prefix=prefix, index=self.index, registry=self.registry,
                                  kv_snapshot=self.cfg.kv_snapshot,
                                  kv_catchup_timeout_s=self.cfg.kv_catchup_timeout_s)
            await self.feeds.start()
            if self.cfg.replica_sync:
                from router.replica_sync import ReplicaSync

                self.sync = ReplicaSync(self.nc, self.state, pool=self.cfg.pool, prefix=prefix,
                                        interval_s=self.cfg.replica_sync_interval_s,
                                        expire_s=self.cfg.replica_sync_expire_s,
                                        index=self.index if self.cfg.replica_sync_routes else None,
                                        registry=self.registry)
                await self.sync.start()
            if self.cfg.records:
                self.records = BusRecordSink(self.nc.jetstream(), self.cfg.pool, buffer=self.cfg.records_buffer,
                                             prefix=prefix, registry=self.registry)
                self.records.start()
        if self.cfg.kubernetes.enabled:
            from router.discovery import KubeDiscovery

            self.kube = KubeDiscovery(self.cfg.kubernetes, self.state, pool=self.cfg.pool)
            await self.kube.start()
        self.service = RouterService(self.cfg, state=self.state, index=self.index, registry=self.registry,
                                     records=self.records)
        if self.feeds is not None and self.index is not None:
            self.service.kv_status = self.feeds.kv_status
        if self.sync is not None:
            self.service.replicas = self.sync.info
            if self.cfg.replica_sync_routes:
                self.service.on_route = self.sync.add_route
                self.service.on_route_end = self.sync.add_end
                self.sync.piece_routes = self.service.piece_routes
        url = await self.service.start(host, port)
        if self.cfg.epp_port is not None:
            from router.epp import start_epp

            self.epp = await start_epp(self.service, host or self.cfg.host, self.cfg.epp_port,
                                       fallbacks=self.cfg.epp_fallbacks)
        return url

    async def stop(self, drain: bool = True) -> bool:
        """Drain in-flight requests (if asked), then stop everything; True if the drain completed."""
        drained = True
        if self.epp is not None:
            await self.epp.stop()
        if self.service is not None:
            if drain:
                drained = await self.service.drain()
            await self.service.stop()
        if self.kube is not None:
            await self.kube.stop()
        if self.sync is not None:
            await self.sync.stop()
        if self.records is not None:
            await self.records.flush(timeout=3.0)
            await self.records.stop()
        if self.feeds is not None:
            await self.feeds.stop()
        if self.nc is not None:
            try:
                await self.nc.drain()
            except Exception:  # noqa: BLE001 - shutting down
                await self.nc.close()
        return drained
