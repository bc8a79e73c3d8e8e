"""Services that wire the bus to the folds: bridges, collectors, indexer, diagnosis,
SLA sink, planner, replay, export.

Owns: everything that reads from or writes to NATS JetStream (:mod:`consumers.bus`
holds the shared connection, topology-apply, publish-with-dedupe, dead-letter and
durable-consumer helpers; :mod:`consumers.http` the HTTP/1.1 server of the indexer's and
the router's APIs), and the adapters from external formats (vLLM ZMQ frames,
Prometheus text, npu-smi output) to :mod:`schemas` events.

May import: :mod:`schemas`, :mod:`streams`, and I/O libraries (nats, zmq, httpx,
chdb, clickhouse_connect, aiokafka, kubernetes). Not :mod:`router` or :mod:`infernex`.
A consumer decodes, applies a fold, acks; rules and state live in :mod:`streams`.
"""
