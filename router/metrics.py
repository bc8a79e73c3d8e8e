"""The router's per-request metrics, kept as plain numbers and exposed through a prometheus_client
collector registered in the injected registry.

prometheus_client's ``Counter``/``Histogram`` take a lock per update and walk the buckets in
Python; a proxied request makes ~10 such updates (~10-15 µs on this machine). Here an update is
an attribute add, a histogram observation is one ``bisect`` (C) and an add; the cumulative
buckets are computed only when ``/metrics`` is scraped. Single-threaded use (the event loop).
Names, labels and samples are the same as with prometheus_client objects.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

DEFAULT_BUCKETS = (.005, .01, .025, .05, .075, .1, .25, .5, .75, 1.0, 2.5, 5.0, 7.5, 10.0)
# LLM requests run for minutes: end-to-end, TTFT and queue time up to 10 minutes
LATENCY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ITL_BUCKETS = (.001, .0025, .005, .01, .02, .04, .06, .08, .1, .15, .2, .3, .4, .5, .75, 1.0, 2.5, 5.0, 10.0)
LOOP_LAG_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1.0, 2.5)


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket (not cumulative); the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # first bound >= value: the "le" bucket
        self.sum += value


class _Family:
    def __init__(self, kind: str, name: str, doc: str, labelnames: Sequence[str], buckets: Sequence[float] = ()):
        self.kind, self.name, self.doc, self.labelnames = kind, name, doc, tuple(labelnames)
        self.bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        self.children: dict[tuple[str, ...], CounterChild | HistogramChild] = {}
        if not self.labelnames:
            self.labels()

    def labels(self, *values: str):
        key = tuple(str(v) for v in values)
        c = self.children.get(key)
        if c is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {key}")
            c = self.children[key] = HistogramChild(self.bounds) if self.kind == "histogram" else CounterChild()
        return c

    # unlabelled families act as their only child
    def inc(self, amount: float = 1.0) -> None:
        self.children[()].inc(amount)

    def observe(self, value: float) -> None:
        self.children[()].observe(value)

    def collect(self) -> Metric:
        if self.kind == "counter":
            fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
            for key, c in self.children.items():
                fam.add_metric(list(key), c.value)
            return fam
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for key, h in self.children.items():
            acc, buckets = 0, []
            for le, n in zip(les, h.counts):
                acc += n
                buckets.append((le, acc))
            fam.add_metric(list(key), buckets, h.sum)
        return fam


class FastMetrics:
    """A collector of cheap counters and histograms (plus gauges read at scrape time)."""

    def __init__(self, registry: CollectorRegistry):
        self._families: list[_Family] = []
        self._gauges: list[tuple[str, str, object]] = []
        registry.register(self)

    def counter(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> _Family:
        if name.endswith("_total"):
            name = name[:-6]
        f = _Family("counter", name, doc, labelnames)
        self._families.append(f)
        return f

    def histogram(self, name: str, doc: str, labelnames: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_BUCKETS) -> _Family:
        f = _Family("histogram", name, doc, labelnames, buckets)
        self._families.append(f)
        return f

    def gauge_function(self, name: str, doc: str, fn) -> None:
        """A gauge whose value is ``fn()`` when scraped."""
        self._gauges.append((name, doc, fn))

    def collect(self) -> Iterator[Metric]:
        for f in self._families:
            yield f.collect()
        for name, doc, fn in self._gauges:
            yield GaugeMetricFamily(name, doc, value=float(fn()))

    def describe(self) -> Iterator[Metric]:
        for f in self._families:
            yield (CounterMetricFamily if f.kind == "counter" else HistogramMetricFamily)(f.name, f.doc)
        for name, doc, _ in self._gauges:
            yield GaugeMetricFamily(name, doc)


async def watch_loop_lag(observe, interval_s: float = 0.05) -> None:
    """Until cancelled: every ``interval_s``, how much later than asked the event loop woke this
    task, to ``observe`` (seconds). Every request, stream event and bus message of the process
    waits that long for the loop too, so a lag seen here is latency added to all of them: work
    that holds the loop (a long computation, a large synchronous write) or a process starved of CPU."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(interval_s)
        observe(max(0.0, loop.time() - t - interval_s))


class PluginEventsCollector:
    """``infernex_router_plugin_events_total{plugin, event}``: what strategy plugins count
    (:meth:`router.plugins.base.Plugin.events`), e.g. PD-Bucket falling back to another group."""

    def __init__(self, strategy_getter) -> None:  # noqa: ANN001 - a callable returning the live Strategy
        self._strategy = strategy_getter

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("infernex_router_plugin_events", "Events counted by strategy plugins",
                                  labels=["plugin", "event"])
        seen = set()
        for prof in self._strategy().profiles.values():
            for p in prof.filters + [s for s, _ in prof.scorers] + [prof.picker]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                for ev, n in p.events().items():
                    fam.add_metric([p.name, ev], n)
        yield fam
