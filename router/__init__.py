"""hermes-router: the OpenAI-compatible HTTP router.

Owns: the HTTP API, strategy plugins (filters, scorers, pickers, profiles), the PD
two-stage proxy, backend discovery, resilience (retries, migration, circuit breakers,
drain) and the request records it publishes.

May import: :mod:`schemas`, :mod:`streams` (it embeds folds such as the KV index and
load state), :mod:`consumers.bus` for publishing and subscribing, :mod:`consumers.http` (the HTTP/1.1
server under its API, which the indexer's API uses too), and the simulator's tokenizers. Strategy plugins are pure: they read state snapshots passed in and never do I/O.

Map
    ``types``      BackendState, RoutingRequest, Decision (plain data)
    ``plugins/``   filters, scorers, pickers, profile handlers; registry type name -> class
    ``profiles``   strategy YAML (GIE EndpointPickerConfig style) -> Strategy; built-ins in ``strategies/``
    ``core``       ``Router.decide(request, backends, index_view, now)``: pure, no asyncio
    ``state``      ClusterState: discovery sources + load/health folds + in-flight counters
    ``server``     the service: forwarding, SSE pass-through, PD, retries, migration, drain, auth
    ``admission``  per-backend in-flight caps from the router's own counts, bounded queue, key quotas
    ``openapi``    request models (msgspec) checked on every request, and the OpenAPI 3.1 document
    ``upstream``   the pooled keep-alive HTTP/1.1 client to the engines (asyncio Protocol + httptools)
    ``metrics``    cheap per-request counters/histograms exposed through a prometheus_client collector
    ``feeds``      NATS inputs (announcements, metrics, diagnoses, KV events) -> state / KvIndex
    ``records``    RoutingDecision / RequestRecord publisher (bounded, drops counted)
    ``discovery``  Kubernetes pods by label selector (list + watch)
    ``app``        wiring used by ``infernex router``; ``testing`` a fake engine for tests
"""
