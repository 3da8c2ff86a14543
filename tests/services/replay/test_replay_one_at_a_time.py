"""One replay at a time (``pipeline.services.replay.versions``, *One replay at a time*), on
the real broker: two replays claim different versions, a second handover is refused while
one is pending, a request replaced while it waits stops its replay without withdrawing the
other, and ``replay --withdraw-handover`` clears the request a dead replay left, which a
live writer shows and reports while it holds for it."""

from __future__ import annotations

import asyncio
import logging

import pytest
from fanout_support import FIXTURES, SERDE, fanout_settings, publish

from pipeline.adapters.kafka import projection_follow
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.projection_follow import ProjectionFollow
from pipeline.adapters.kafka.topic_scan import ensure_topic, topic_exists
from pipeline.cli.main import main
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import BrokerError
from pipeline.core.projection import HandoverRequest, handover_key, writer_key
from pipeline.services.replay.rebuild import replay_projection
from pipeline.services.replay.versions import (
    ActiveVersion,
    claim_version,
    read_pointer,
    request_handover,
    version_topic,
    withdraw_handover,
    write_pointer,
)
from pipeline.settings import Settings

pytestmark = pytest.mark.broker
P = "derived-messages"


async def _pending(settings: Settings) -> HandoverRequest | None:
    return (await read_pointer(settings)).pending()


async def _plant_request(settings: Settings, version: int, request: str) -> HandoverRequest:
    """A handover another replay asked for (a live writer registered, so it is waited on)."""
    planted = HandoverRequest(version, version_topic(settings, version), request)
    await write_pointer(settings, {writer_key(P, "w1"): {"worker": "w1"},
                                   handover_key(P): planted.to_json()})
    return planted


def test_concurrent_claims_get_different_versions_and_skip_existing_topics(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)

    async def scenario() -> list[int]:
        await ensure_topic(settings, version_topic(settings, 1), compact=True)  # left behind
        assert not await ensure_topic(settings, version_topic(settings, 1), compact=True)
        active = ActiveVersion(0, settings.topics.derived_messages)
        return sorted(await asyncio.gather(*(claim_version(settings, active)
                                             for _ in range(3))))

    assert asyncio.run(scenario()) == [2, 3, 4]


def test_a_second_handover_is_refused_and_only_an_operator_withdraws_the_first(
        kafka_bootstrap: str, topic_prefix: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    events = read_session_file(FIXTURES / "text-turn.jsonl").events

    async def scenario() -> HandoverRequest:
        await ensure_topics(settings)
        await publish(settings, "text-turn", events)
        first = await _plant_request(settings, 7, "first-replay")
        with pytest.raises(BrokerError, match=r"another replay is handing over version 7 .*"
                                              r"first-replay.*--withdraw-handover"):
            await replay_projection(settings, SERDE.decode, handover_timeout_s=5)
        # Refused before it rebuilt anything (no version claimed), and it withdrew nothing:
        # the first's request is still pending.
        assert not await topic_exists(settings, version_topic(settings, 1))
        assert await _pending(settings) == first
        assert await withdraw_handover(settings, HandoverRequest(8, "t", "other")) is None
        assert await _pending(settings) == first
        return first

    first = asyncio.run(scenario())
    for name, value in settings.to_env().items():
        monkeypatch.setenv(name, value)
    assert main(["replay", "--withdraw-handover"]) == 0
    assert f"withdrew the handover to version 7 ({first.topic}, request first-replay)" \
        in capsys.readouterr().err
    assert asyncio.run(_pending(settings)) is None
    assert main(["replay", "--withdraw-handover"]) == 0
    assert "no handover is pending" in capsys.readouterr().err


def test_a_request_replaced_while_it_waits_stops_its_replay_and_leaves_the_other(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)

    async def scenario() -> None:
        await ensure_topics(settings)
        await write_pointer(settings, {writer_key(P, "w1"): {"worker": "w1"}})
        waiting = asyncio.get_running_loop().create_task(
            request_handover(settings, 1, timeout_s=30))
        while await _pending(settings) is None:   # its request is written; nobody answers
            await asyncio.sleep(0.1)
        other = await _plant_request(settings, 2, "written-in-the-same-instant")
        with pytest.raises(BrokerError, match=r"version 2 .*was replaced"):
            await waiting
        assert await _pending(settings) == other   # not withdrawn by the replay that lost

    asyncio.run(scenario())


def test_a_writer_shows_the_hold_and_reports_one_that_lasts(
        kafka_bootstrap: str, topic_prefix: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    monkeypatch.setattr(projection_follow, "LONG_HOLD_S", 0.0)   # every poll is "long"
    follow = ProjectionFollow(settings, "w2", lambda: {0, 1, 2})

    async def scenario() -> tuple[object, object]:
        await follow.refresh()
        idle = follow.status()["holding"]
        planted = await _plant_request(settings, 5, "died-holding")
        with caplog.at_level(logging.WARNING, projection_follow.__name__):
            await follow.refresh()
        holding = follow.status()["holding"]
        assert isinstance(holding, dict)
        assert (holding["version"], holding["request"]) == (5, planted.request)
        assert await withdraw_handover(settings, None) == planted
        await follow.refresh()
        return idle, follow.status()["holding"]

    assert asyncio.run(scenario()) == (None, None)
    assert any("version 5 (request died-holding)" in r.getMessage()
               and "--withdraw-handover" in r.getMessage() for r in caplog.records)
