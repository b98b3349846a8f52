"""Fetch requests name the partitions of small records first (streams/runtime/fetch_order.py),
and the hook that does it fits the pinned aiokafka's fetcher."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from aiokafka import TopicPartition
from aiokafka.consumer.fetcher import Fetcher as Real
from aiokafka.protocol.fetch import FetchRequest

from streams.runtime.fetch_order import FetchOrder, install


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request(*topics: str) -> list[tuple[str, list[tuple[int, int, int]]]]:
    return [(t, [(0, 10, 1 << 20), (1, 10, 1 << 20)]) for t in topics]


def test_partitions_of_small_records_are_named_first_and_large_ones_take_turns() -> None:
    clock = Clock()
    order = FetchOrder(half_life_s=5.0, shuffled_every=0, clock=clock)
    for p in (0, 1):
        order.observe(TopicPartition("in.rt.abuser", p), 1_300_000)
        order.observe(TopicPartition("in.rt.victim", p), 400)
    clock.now += 1.0
    order.observe(TopicPartition("in.rt.abuser", 1), 1_300_000)  # served again: its size is fresher
    topics = request("in.rt.abuser", "in.rt.victim")
    order.reorder(topics)
    assert [t for t, _ in topics] == ["in.rt.victim", "in.rt.abuser"]
    assert [p for p, _, _ in topics[1][1]] == [0, 1]  # the large partition served longest ago first


def test_a_partition_never_seen_counts_as_small_and_old_sizes_fade() -> None:
    clock = Clock()
    order = FetchOrder(half_life_s=5.0, shuffled_every=0, clock=clock)
    order.observe(TopicPartition("big", 0), 1_000_000)
    order.observe(TopicPartition("photos", 0), 200_000)
    topics = request("big", "photos", "new")
    order.reorder(topics)
    assert [t for t, _ in topics] == ["new", "photos", "big"]
    clock.now += 15.0  # three half-lives: 125 KB remembered, under the photos' fresh 200 KB
    order.observe(TopicPartition("photos", 0), 200_000)
    order.reorder(topics)
    assert [t for t, _ in topics] == ["new", "big", "photos"]


def test_one_request_in_n_keeps_the_clients_order_so_nothing_starves() -> None:
    order = FetchOrder(shuffled_every=4)
    order.observe(TopicPartition("big", 0), 1_000_000)
    kept = 0
    for _ in range(8):
        topics = request("big", "small")
        order.reorder(topics)
        kept += topics[0][0] == "big"
    assert kept == 2


def hooked(order: FetchOrder, built: FetchRequest) -> list[tuple[int, FetchRequest]]:
    """The requests a fetcher whose ``_get_actions_per_node`` builds ``built`` sends once
    ``install`` has hooked it (the shape the pinned aiokafka's method returns)."""
    class Fetcher:
        def _get_actions_per_node(self, assignment):
            return [(0, built)], {}, 0.1, [], False

    consumer = SimpleNamespace(_fetcher=Fetcher())
    install(consumer, order)
    return consumer._fetcher._get_actions_per_node(None)[0]


def test_the_hook_reorders_the_requests_of_the_pinned_aiokafka_fetcher() -> None:
    # What the hook relies on in the pinned aiokafka: the method, its one argument, and
    # requests whose topics are a list it may sort.
    assert list(inspect.signature(Real._get_actions_per_node).parameters) == ["self", "assignment"]
    built = FetchRequest(500, 1, 1 << 20, 0, request("big", "small"))
    assert isinstance(built._topics, list) and built.topics is built._topics
    order = FetchOrder(shuffled_every=0)
    order.observe(TopicPartition("big", 0), 1_000_000)
    assert [t for t, _ in hooked(order, built)[0][1].topics] == ["small", "big"]


def test_rt_topics_come_before_bulk_ones_whatever_their_sizes() -> None:
    order = FetchOrder(shuffled_every=0, rank=lambda topic: int(topic.endswith(".bulk")))
    order.observe(TopicPartition("encode.image.rt", 0), 200_000)
    order.observe(TopicPartition("encode.image.bulk", 0), 300)
    topics = request("encode.image.bulk", "encode.image.rt")
    order.reorder(topics)
    assert [t for t, _ in topics] == ["encode.image.rt", "encode.image.bulk"]


def test_a_failing_order_leaves_the_request_as_the_client_built_it() -> None:
    class Broken(FetchOrder):
        def reorder(self, topics):
            raise RuntimeError("a bug in the order")

    built = FetchRequest(500, 1, 1 << 20, 0, request("big", "small"))
    assert [t for t, _ in hooked(Broken(), built)[0][1].topics] == ["big", "small"]
