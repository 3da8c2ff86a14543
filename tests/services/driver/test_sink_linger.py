"""The driver's flusher lingers from the oldest record not yet committing, as a Kafka
producer's linger counts from a batch's first record: records that waited for the previous
commit have lingered already and go into the next transaction at once."""

from __future__ import annotations

import time

from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.codec.avro import EventSerde
from pipeline.services.driver.kafka_sink import InboxOffsets, PartitionSink
from pipeline.settings import Settings


def _sink(linger_ms: float) -> PartitionSink:
    producer = PartitionProducer(Settings(), group_id="g", partition=0)  # never started
    return PartitionSink(producer, events_topic="e", inbox_topic="i", partition=0,
                         encode=EventSerde().encode, offsets=InboxOffsets(0),
                         on_logged=lambda _session, _message: None, linger_ms=linger_ms)


def test_with_nothing_buffered_a_wake_up_lingers_the_whole_time() -> None:
    assert _sink(linger_ms=40)._linger_left() == 0.04


def test_a_record_that_waited_the_linger_time_already_does_not_linger_again() -> None:
    sink = _sink(linger_ms=20)
    sink.add(OutRecord("e", b"k", b"v", (), 0))
    time.sleep(0.03)  # e.g. the previous transaction's commit
    assert sink._linger_left() == 0.0


def test_a_fresh_record_lingers_what_is_left_of_the_time() -> None:
    sink = _sink(linger_ms=60_000)
    sink.add(OutRecord("e", b"k", b"v", (), 0))
    time.sleep(0.01)
    assert 0.0 < sink._linger_left() < 60.0 - 0.01
