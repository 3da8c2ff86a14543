"""Pure tests of the driver's pieces: inbox command codec, offset tracking, dead letters."""

from __future__ import annotations

import argparse
import contextlib
import json
import random

import pytest

from pipeline.adapters.kafka.dlq import dead_letter
from pipeline.adapters.kafka.records import InboxRecord, header_value
from pipeline.cli.cmd_send import command_from_args, register
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.records import event_headers
from pipeline.core.errors import CodecError, ConfigError, SchemaError
from pipeline.core.events import Event
from pipeline.core.inbox import Cancel, Configure, FollowUp, InboxCommand, Inject, Steer
from pipeline.core.turn_config import CONFIG_TYPE
from pipeline.services.driver.inbox_offsets import (
    MAX_METADATA_CHARS,
    InboxOffsets,
    applied_from_metadata,
    dead_lettered_from_metadata,
)
from pipeline.services.driver.kafka_sink import logged_message_ids

COMMANDS: list[InboxCommand] = [
    FollowUp("s-1", "m-1", ({"type": "text", "text": "héllo ✓"},)),
    Steer("s-1", "m-2", ({"type": "text", "text": "left"}, {"type": "future-kind", "x": [1, 2.5]}),
          source={"kind": "plugin", "plugin": "p"}),
    Inject("s-1", "m-3", ({"type": "text", "text": ""},)),
    Cancel("s-1", "m-4", keep_queue=True),
    Cancel("s-1", "m-5"),
    Configure("s-1", "m-6", provider="deepseek", model="deepseek-chat", system="be brief",
              tools=(), reasoning_effort="high", max_tokens=4096),
    Configure("s-1", "m-7", tools=("echo", "clock")),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.kind}-{c.message_id}")
def test_inbox_commands_round_trip_in_both_framings(command: InboxCommand) -> None:
    single = InboxCodec()
    confluent = InboxCodec(confluent_id=42)
    assert single.decode(single.encode(command)) == command
    framed = confluent.encode(command)
    assert framed[0] == 0 and int.from_bytes(framed[1:5], "big") == 42
    assert confluent.decode(framed) == command
    assert confluent.decode(single.encode(command)) == command  # a reader accepts both


def test_unknown_registry_id_and_fingerprint_are_schema_errors() -> None:
    data = InboxCodec(confluent_id=7).encode(COMMANDS[0])
    with pytest.raises(SchemaError, match="schema id 7"):
        InboxCodec().decode(data)
    single = InboxCodec().encode(COMMANDS[0])
    with pytest.raises(SchemaError, match="fingerprint"):
        InboxCodec().decode(single[:2] + bytes(8) + single[10:])


def test_invalid_command_is_a_codec_error_naming_the_problem() -> None:
    codec = InboxCodec()
    data = bytearray(codec.encode(Cancel("s", "m")))
    # kind "cancel" -> "cancex": a kind nobody knows
    at = data.index(b"cancel")
    data[at:at + 6] = b"cancex"
    with pytest.raises(CodecError, match="unknown command kind"):
        codec.decode(bytes(data))


def test_random_and_mutated_bytes_never_escape_as_foreign_exceptions() -> None:
    codec = InboxCodec()
    rng = random.Random(4)
    samples = [codec.encode(c) for c in COMMANDS]
    for _ in range(2000):
        base = bytearray(rng.choice(samples))
        for _ in range(rng.randint(1, 4)):
            base[rng.randrange(len(base))] = rng.randrange(256)
        cut = bytes(base[: rng.randint(0, len(base))]) if rng.random() < 0.3 else bytes(base)
        with contextlib.suppress(CodecError):
            codec.decode(cut)
    for _ in range(500):
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
        with contextlib.suppress(CodecError):
            codec.decode(junk)


def test_offsets_commit_point_waits_for_the_oldest_unfinished_command() -> None:
    offsets = InboxOffsets(committed=10)
    for offset in (10, 11, 13, 14):  # 12 is a transaction marker: never seen
        offsets.start(offset)
    assert offsets.advance() is None
    offsets.done(11)
    offsets.done(13)
    assert offsets.advance() is None and offsets.in_flight == 2
    offsets.done(10)
    assert offsets.advance() == (14, "")
    offsets.done(14)
    assert offsets.advance() == (15, "")
    assert offsets.advance() is None
    assert offsets.seen(9) and offsets.seen(14) and not offsets.seen(15)


def test_control_commands_applied_beyond_the_commit_point_travel_in_the_metadata() -> None:
    offsets = InboxOffsets(committed=0)
    offsets.start(0)  # a follow-up still running
    offsets.start(1)  # a cancel, applied at once
    offsets.applied_control(1, "cancel-1")
    offsets.done(1)
    point = offsets.advance()
    assert point == (0, '{"applied":["cancel-1"]}')
    # The next owner reads that metadata and skips the re-delivered cancel.
    assert applied_from_metadata(point[1]) == {"cancel-1"}
    offsets.done(0)
    assert offsets.advance() == (2, "")  # past the cancel: nothing left to remember
    assert applied_from_metadata("not json") == frozenset()


def test_dead_letters_beyond_the_commit_point_travel_in_the_metadata() -> None:
    offsets = InboxOffsets(committed=0)
    offsets.start(0)  # a follow-up still running
    offsets.start(1)  # garbage: its dead letter goes out with the next transaction
    offsets.dead_letter(1)
    offsets.start(2)  # a cancel, applied at once
    offsets.applied_control(2, "cancel-2")
    offsets.done(2)
    point = offsets.advance()
    assert point == (0, '{"applied":["cancel-2"],"dead":[1]}')
    # The next owner reads that metadata and does not dead-letter offset 1 again.
    after_crash = InboxOffsets(0, applied_from_metadata(point[1]),
                               dead_lettered_from_metadata(point[1]))
    assert after_crash.already_dead_lettered(1) and not after_crash.already_dead_lettered(0)
    offsets.done(0)
    assert offsets.advance() == (3, "")  # past both: nothing left to remember
    assert dead_lettered_from_metadata('{"dead":[1,"x",true]}') == {1}
    assert dead_lettered_from_metadata("[1]") == frozenset()


def test_commit_metadata_stays_under_the_broker_limit_dropping_the_oldest_first() -> None:
    offsets = InboxOffsets(committed=0)
    offsets.start(0)
    for offset in range(1, 2001):
        offsets.start(offset)
        offsets.dead_letter(offset)
    point = offsets.advance()
    assert point is not None and len(point[1]) <= MAX_METADATA_CHARS
    kept = dead_lettered_from_metadata(point[1])
    assert 2000 in kept and 1 not in kept


def test_dead_letter_keeps_key_bytes_and_headers_and_says_why() -> None:
    record = InboxRecord(topic="x.inbox", partition=2, offset=77, key=b"s-1", value=b"\xffjunk",
                         headers=(("traceparent", b"00-abc-def-01"),))
    letter = dead_letter(record, CodecError("not framed Avro " + "x" * 2000))
    assert letter.topic == "x.inbox.dlq" and letter.key == b"s-1" and letter.value == b"\xffjunk"
    assert header_value(letter.headers, "traceparent") == b"00-abc-def-01"
    assert header_value(letter.headers, "dsh.error.class") == b"CodecError"
    message = header_value(letter.headers, "dsh.error.message")
    assert message is not None and message.startswith(b"not framed Avro") and len(message) <= 1000
    assert header_value(letter.headers, "dsh.original.topic") == b"x.inbox"
    assert header_value(letter.headers, "dsh.original.partition") == b"2"
    assert header_value(letter.headers, "dsh.original.offset") == b"77"


def test_a_dead_letter_too_large_for_a_record_keeps_all_but_the_value() -> None:
    """A refused dead letter would hold back the offset it stands for, for good: it names
    where the value still is instead (the original topic, partition and offset)."""
    record = InboxRecord(topic="x.session-events", partition=1, offset=9, key=b"s-1",
                         value=b"v" * 999_900, headers=(("dsh.type", b"user/message"),))
    kept = dead_letter(record, CodecError("bad"), max_record_bytes=1_048_576)
    assert kept.value == record.value and header_value(kept.headers, "dsh.original.omitted") \
        is None
    letter = dead_letter(record, CodecError("bad"))   # 1,000,000 bytes by default
    assert letter.value == b"" and letter.key == b"s-1"
    assert header_value(letter.headers, "dsh.original.omitted") == b"999900 bytes"
    assert header_value(letter.headers, "dsh.original.offset") == b"9"
    assert header_value(letter.headers, "dsh.type") == b"user/message"
    assert header_value(letter.headers, "dsh.error.class") == b"CodecError"


def test_logged_message_ids_come_from_splices_user_messages_and_config_events() -> None:
    splice = Event("agent/inbox/spliced", 0, 1, {"target": "next-turn", "start": 0,
                                                 "inserted": [{"id": "m-1", "role": "user"}]})
    claim = Event("agent/inbox/spliced", 2, 1, {"target": "next-turn", "start": 0,
                                                "removedCount": 1, "inserted": []})
    user = Event("user/message", 4, 1, {"id": "m-9", "role": "user", "content": []})
    assert list(logged_message_ids(splice)) == ["m-1"]
    assert list(logged_message_ids(claim)) == []
    assert list(logged_message_ids(user)) == ["m-9"]
    configured = Event(CONFIG_TYPE, 5, 1, {"messageId": "c-1", "header": {
        "config": {"provider": "scripted", "model": "m"}}}, ignorable=True)
    assert list(logged_message_ids(configured)) == ["c-1"]
    assert tuple(event_headers(user)) == (("dsh.type", b"user/message"), ("dsh.seq", b"4"))


def test_unknown_registry_id_is_looked_up_once_and_cached() -> None:
    writer = InboxCodec(confluent_id=99)
    asked: list[int] = []

    def lookup(schema_id: int) -> str:
        asked.append(schema_id)
        return json.dumps(writer.schema_json)

    reader = InboxCodec(confluent_id=5, lookup=lookup)
    for command in COMMANDS:
        assert reader.decode(writer.encode(command)) == command
    assert asked == [99]


def send_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["send", *argv])


def test_send_arguments_become_the_commands_they_describe() -> None:
    followup = command_from_args(send_args("s-9", "--followup", "hi", "--message-id", "m-1"))
    assert followup == FollowUp("s-9", "m-1", ({"type": "text", "text": "hi"},))
    cancel = command_from_args(send_args("s-9", "--cancel", "--keep-queue"))
    assert isinstance(cancel, Cancel) and cancel.keep_queue and cancel.message_id
    configure = command_from_args(send_args("s-9", "--configure", "--model", "m",
                                            "--tools", "echo,clock", "--max-tokens", "64"))
    assert configure == Configure("s-9", configure.message_id, model="m",
                                  tools=("echo", "clock"), max_tokens=64)
    assert command_from_args(send_args("s-9", "--configure", "--tools", "")).tools == ()
    tenanted = command_from_args(send_args("s-9", "--cancel", "--tenant", "acme"))
    assert isinstance(tenanted, Cancel) and tenanted.tenant == "acme"
    with pytest.raises(ConfigError, match="not a valid name"):
        command_from_args(send_args("s-9", "--cancel", "--tenant", "a b"))


@pytest.mark.parametrize("argv, complaint", [
    (("--configure",), "needs at least one of"),
    (("--followup", "x", "--keep-queue"), "--keep-queue only goes with --cancel"),
    (("--cancel", "--model", "m"), "--model only go"),
])
def test_send_refuses_options_that_do_not_fit(argv: tuple[str, ...], complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint):
        command_from_args(send_args("s-9", *argv))
