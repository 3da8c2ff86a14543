"""``dsh-pipeline topics ensure`` against the real broker and registry."""

from __future__ import annotations

import json

import pytest

from pipeline.adapters.registry.client import RegistryClient, value_subject
from pipeline.cli.main import main
from pipeline.settings import Settings


def _use(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSH_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    monkeypatch.setenv("DSH_REGISTRY_URL", settings.registry_url)
    monkeypatch.setenv("DSH_TOPIC_PREFIX", settings.topic_prefix)
    monkeypatch.setenv("DSH_PARTITIONS", str(settings.partitions))


def test_topics_ensure_creates_once_and_registers_every_subject(
        settings: Settings, registry_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _use(settings, monkeypatch)
    assert main(["topics", "ensure"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert settings.topics.session_events in first["created"]
    assert settings.topics.inbox in first["created"]
    assert main(["topics", "ensure", "--no-registry"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["created"] == []
    assert sorted(second["existing"]) == sorted(first["created"] + first["existing"])
    with RegistryClient.from_settings(settings) as client:
        names = settings.topics
        for topic in (names.session_events, names.inbox, names.derived_messages, names.usage,
                      names.fleet):
            assert client.get_compatibility(value_subject(topic)) == "BACKWARD_TRANSITIVE"
        derived = json.loads(client.get_schema(client.latest(
            value_subject(names.derived_messages))[0]))
        assert derived["name"] == "DerivedMessageChange"


def test_topics_ensure_refuses_a_partition_mismatch_with_a_clear_error(
        settings: Settings, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _use(settings, monkeypatch)
    assert main(["topics", "ensure", "--no-registry"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("DSH_PARTITIONS", str(settings.partitions + 2))
    assert main(["topics", "ensure", "--no-registry"]) == 1  # a failed check
    err = capsys.readouterr().err
    assert settings.topics.session_events in err and "partition" in err
