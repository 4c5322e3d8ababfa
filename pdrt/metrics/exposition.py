"""Prometheus text in and out: parse a report, label it with its sender, merge families, render, read values back.

The text format allows each family once, so reports of several processes
cannot simply be concatenated: their families are parsed, the samples of
each family gathered under one header, and rendered again.
"""

import math
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class Families:
    """A fixed list of families, in the shape `generate_latest` and `CollectorRegistry.register` take."""

    def __init__(self, families: list[Metric] | None = None) -> None:
        self.families = families or []

    def collect(self) -> list[Metric]:
        return self.families

    def describe(self) -> list[Metric]:
        return []  # names change with what is reported; a registry must not check them at registration


def parse(text: bytes) -> list[Metric]:
    """Families of a Prometheus text exposition; ValueError when it is not one."""
    return list(text_string_to_metric_families(text.decode()))


def relabel(families: Iterable[Metric], labels: dict[str, str]) -> list[Metric]:
    """Copies of `families` whose samples carry `labels` too (a label a sample already has wins)."""
    out = []
    for family in families:
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [s._replace(labels={**labels, **s.labels}) for s in family.samples]
        out.append(copy)
    return out


def merge(groups: Iterable[Iterable[Metric]]) -> list[Metric]:
    """One family per name, holding the samples of every group in order (the first group's header wins)."""
    merged: dict[str, Metric] = {}
    for families in groups:
        for family in families:
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples.extend(family.samples)
    return list(merged.values())


def render(families: list[Metric]) -> bytes:
    return generate_latest(Families(families))


def _matches(labels: dict[str, str], wanted: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())


def total(families: Iterable[Metric], sample_name: str, **labels: str) -> float:
    """The sum of every sample called `sample_name` whose labels include `labels` (0 when there is none)."""
    return sum(s.value for f in families for s in f.samples if s.name == sample_name and _matches(s.labels, labels))


def samples(families: Iterable[Metric], sample_name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called `sample_name` whose labels include `labels`."""
    return [(s.labels, s.value) for f in families for s in f.samples
            if s.name == sample_name and _matches(s.labels, labels)]


def quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """The `q` quantile of a histogram from its cumulative (upper bound, count) buckets, as Prometheus estimates it.

    Linear within the bucket that holds the rank; a rank in the +Inf bucket
    gives the largest finite bound. NaN for an empty histogram.
    """
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return math.nan
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in ordered:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def histogram_quantile(q: float, families: Iterable[Metric], name: str, **labels: str) -> float:
    """`quantile` of the histogram `name` summed over every process (and label set) matching `labels`."""
    by_bound: dict[float, float] = {}
    for sample_labels, value in samples(families, f"{name}_bucket", **labels):
        bound = float(sample_labels["le"])
        by_bound[bound] = by_bound.get(bound, 0.0) + value
    return quantile(q, by_bound.items())
