"""The otel service's loop over an in-memory batch source (the broker runs are in
test_otel_broker.py) and a real OTLP/HTTP receiver: the committed offset never passes an
open turn's start and reaches the end once it ended; idle sessions are forgotten past the
limit without losing a turn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from otlp_receiver import OtlpReceiver, attributes
from shared_paths import SHARED_DIR

from pipeline.adapters.kafka.event_batches import EventBatch
from pipeline.adapters.kafka.event_stream import EventRecord
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.otlp.client import OtlpHttpExporter
from pipeline.adapters.otlp.encode import export_request
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import Event
from pipeline.services.otel.service import OtelOptions, OtelService

FIXTURES = SHARED_DIR / "fixtures" / "dsh-format0"


class ListSource:
    """Batches handed over one by one from a list, on partition 0; records commits."""

    def __init__(self, batches: Sequence[Sequence[tuple[str, Event]]]) -> None:
        self._batches = list(batches)
        self._offset = 0
        self.commits: list[dict[int, int]] = []

    async def next_batch(self, *, timeout_ms: int = 0, max_records: int = 0) -> EventBatch:
        batch = EventBatch()
        for session, event in self._batches.pop(0) if self._batches else ():
            batch.records.append(EventRecord(session, event, "t", 0, self._offset, 0))
            batch.last_offsets[0] = self._offset
            self._offset += 1
        return batch

    def assigned(self) -> set[int]:
        return {0}

    async def commit_offsets(self, offsets: Mapping[int, int]) -> None:
        self.commits.append(dict(offsets))


async def no_dead_letters(records: Sequence[OutRecord]) -> None:
    raise AssertionError(f"unexpected dead letters: {records}")


async def test_commits_stop_at_an_open_turn_and_idle_sessions_are_forgotten() -> None:
    events = read_session_file(FIXTURES / "tool-outcome-unknown.jsonl").events
    second_start = next(i for i, e in enumerate(events) if e.type == "turn/start" and e.seq)
    others = [(f"other-{n}", e) for n in range(5)
              for e in read_session_file(FIXTURES / "text-turn.jsonl").events]
    source = ListSource([[("s", e) for e in events[:second_start + 2]], others,
                         [("s", e) for e in events[second_start + 2:]]])
    receiver = OtlpReceiver()
    url = await receiver.start()
    exporter = OtlpHttpExporter(url)
    service = OtelService(source, exporter, encode=export_request,
                          send_dead_letters=no_dead_letters, dlq_topic="t.dlq",
                          options=OtelOptions(max_idle_sessions=3))
    try:
        await service.step()
        assert source.commits == [{0: second_start}]  # the open turn 2 starts there
        assert service.oldest_open_turn_seconds(now_ms=5_000) == 5.0  # its turn/start time 0
        await service.step()
        assert source.commits[-1] == {0: second_start}  # still open: held
        assert len(service._sessions) <= 3  # idle "other-*" sessions forgotten
        await service.step()
        assert source.commits[-1] == {0: len(events) + len(others)}
    finally:
        await exporter.close()
        await receiver.stop()
    turns = {(attributes(s)["gen_ai.conversation.id"], attributes(s)["dsh.turn"])
             for s in receiver.by_name("invoke_agent")}
    assert turns == {("s", 1), ("s", 2), *((f"other-{n}", 1) for n in range(5))}
    assert service.health()[1]["open_turns"] == 0
