"""runtime.records: Kafka's key partitioning (murmur2) agrees with aiokafka's bit for bit."""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as aiokafka_murmur2
from hypothesis import given
from hypothesis import strategies as st

from runtime.records import KeyPartitioner, murmur2


@given(st.binary(max_size=80))
def test_murmur2_is_kafkas(data: bytes) -> None:
    assert murmur2(data) == aiokafka_murmur2(data)


def test_murmur2_of_every_tail_length() -> None:
    for n in range(12):  # 0-3 bytes after the last whole word, each with and without words
        data = bytes(range(200, 200 + n))
        assert murmur2(data) == aiokafka_murmur2(data)


@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=50), st.integers(1, 64))
def test_key_partitioner_picks_the_default_partition(keys: list[bytes], n: int) -> None:
    parts = list(range(n))
    mine = KeyPartitioner()
    for key in keys + keys:  # the second time from the cache
        assert mine(key, parts, parts) == DefaultPartitioner()(key, parts, parts)


def test_key_partitioner_without_a_key_picks_an_available_partition() -> None:
    assert KeyPartitioner()(None, [0, 1, 2], [2]) == 2
