"""The scrape-target book behind a Ray deployment's `/metrics/targets`, on a hand-driven clock."""

from __future__ import annotations

import pytest

from server.ray.targets import ScrapeTarget, TargetBook


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_replica_that_stops_refreshing_drops_out_after_the_ttl():
    clock = Clock()
    book = TargetBook(ttl_s=30, clock=clock)
    book.register("a", ScrapeTarget("10.0.0.1:4001", {"deployment": "cai-dllm"}))
    book.register("b", ScrapeTarget("10.0.0.2:4002", {"deployment": "cai-dllm"}))
    clock.now += 20
    book.register("a", ScrapeTarget("10.0.0.1:4001", {"deployment": "cai-dllm"}))  # a refreshes, b is silent
    clock.now += 10
    assert set(book.live()) == {"a", "b"}  # b at exactly the ttl is still in
    clock.now += 1
    assert set(book.live()) == {"a"}
    clock.now += 30
    assert book.live() == {}


def test_http_sd_format_has_one_group_per_replica_with_its_labels():
    book = TargetBook(clock=Clock())
    book.register("r2", ScrapeTarget("h:2", {"app": "x"}))
    book.register("r1", ScrapeTarget("h:1", {"app": "x"}))
    book.remove("r2")
    book.remove("never-registered")
    assert book.http_sd() == [{"targets": ["h:1"], "labels": {"replica": "r1", "app": "x"}}]


def test_ttl_must_be_positive():
    with pytest.raises(ValueError, match="ttl_s"):
        TargetBook(ttl_s=0)
