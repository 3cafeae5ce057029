"""Counters and histograms that one thread fills without a lock, exposed by a collector at scrape time.

prometheus_client's take a lock and 2-4 us a call (`labels()` lookup included): at 256 requests a step,
per-token observations cost about a millisecond a step of interpreter time, shared through the GIL with
the engine thread. These are a list index and an addition. Each object has one writer thread (the engine
thread, or the event loop); a scrape may see a histogram's buckets one observation behind its sum.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class Count:
    __slots__ = ("value",)

    def __init__(self):
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class Hist:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]):
        self.bounds, self.counts, self.sum = tuple(bounds), [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le is inclusive: the first bound >= value
        self.sum += value

    def add_to(self, family: HistogramMetricFamily, values: list[str]) -> None:
        cumulative = list(accumulate(self.counts))
        buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative, strict=False)]
        family.add_metric(values, buckets + [("+Inf", cumulative[-1])], self.sum)

    def family(self, name: str, doc: str, labels: dict[str, str]) -> HistogramMetricFamily:
        h = HistogramMetricFamily(name, doc, labels=list(labels))
        self.add_to(h, list(labels.values()))
        return h


class Family:
    """A labelled counter (`bounds` None) or histogram; `labels(*values)` as prometheus_client's. A collector."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str], bounds: Sequence[float] | None = None):
        self.name, self.doc, self.labelnames, self.bounds = name, doc, list(labelnames), bounds
        self.children: dict[tuple[str, ...], Count | Hist] = {}

    def labels(self, *values: str) -> Count | Hist:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = Count() if self.bounds is None else Hist(self.bounds)
        return child

    def collect(self):
        if self.bounds is None:
            family = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
            for values, child in list(self.children.items()):
                family.add_metric(list(values), child.value)
        else:
            family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
            for values, child in list(self.children.items()):
                child.add_to(family, list(values))
        yield family
