"""``dsh-pipeline processors`` arguments and options: bad values are refused clearly."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.adapters.faust.transport import COMMIT_EVERY_ACKS_NEVER
from pipeline.cli.cmd_processors import parse_windows, prices_of
from pipeline.cli.main import build_parser
from pipeline.codec.avro import EventSerde
from pipeline.core.errors import ConfigError
from pipeline.services.processors.app import build_processors
from pipeline.services.processors.options import ProcessorsOptions
from pipeline.settings import Settings


def test_windows_parse_to_milliseconds() -> None:
    assert parse_windows("minute=60, hour=3600") == {"minute": 60_000, "hour": 3_600_000}
    assert parse_windows("2s=2") == {"2s": 2_000}


@pytest.mark.parametrize("text", ["", "minute", "minute=0", "a/b=1", "minute=x"])
def test_bad_windows_are_refused_naming_the_part(text: str) -> None:
    with pytest.raises(ConfigError, match="--windows"):
        parse_windows(text)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("web_port", 0, "web port"), ("grace_ms", -1, "grace"), ("tick_interval_s", 0, "tick"),
    ("store", "redis://", "store"), ("session_timeout_s", 1, "session timeout"),
    ("fetch_max_wait_ms", 0, "fetch max wait"), ("fetch_min_bytes", 0, "fetch min bytes"),
])
def test_bad_options_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ProcessorsOptions(**{field: value})  # type: ignore[arg-type]


def test_app_id_is_scoped_by_topic_and_group_prefix() -> None:
    settings = Settings.from_env({}, topic_prefix="t1.", group_id_prefix="g-")
    options = ProcessorsOptions()
    assert options.app_id(settings) == "g-t1.processors"
    assert options.usage_topic(settings) == "g-t1.processors-usage-by-model"


def test_the_command_is_registered_with_its_options() -> None:
    args = build_parser().parse_args(["processors", "--web-port", "7001", "--grace", "2"])
    assert (args.port, args.grace, args.store) == (7001, 2.0, "memory://")
    defaults = ProcessorsOptions()
    assert (args.fetch_max_wait_ms, args.fetch_min_bytes) == (defaults.fetch_max_wait_ms,
                                                              defaults.fetch_min_bytes)


def test_the_fetch_options_reach_the_kafka_consumer() -> None:
    """faust passes neither to aiokafka: the worker's consumer thread sets them."""
    options = ProcessorsOptions(fetch_max_wait_ms=7, fetch_min_bytes=1234)
    processors = build_processors(Settings.from_env({}), EventSerde().decode, options)

    async def created() -> tuple[int, int, str]:
        thread = processors.app.consumer._thread
        consumer = thread._create_worker_consumer(processors.app.transport)
        try:
            return (consumer._fetch_max_wait_ms, consumer._fetch_min_bytes,
                    consumer._isolation_level)
        finally:
            await consumer.stop()

    assert asyncio.run(created()) == (7, 1234, "read_committed")


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("rocksdict") is not None,
                    reason="rocksdict is installed")
def test_rocksdb_store_without_rocksdict_says_what_to_install() -> None:
    with pytest.raises(ConfigError, match="pip install rocksdict"):
        ProcessorsOptions(store="rocksdb://")


def test_offsets_are_committed_by_the_commit_timer_only() -> None:
    """faust's other trigger (every ``broker_commit_every`` acks) commits inside the loop
    that hands fetched records to the agents, stalling every partition meanwhile."""
    processors = build_processors(Settings.from_env({}), EventSerde().decode)
    # faust's public setting, out of reach: the consumer reads it when it is built.
    assert processors.app.conf.broker_commit_every == COMMIT_EVERY_ACKS_NEVER
    assert processors.app.consumer._commit_every == COMMIT_EVERY_ACKS_NEVER
    assert processors.app.consumer.commit_interval == processors.app.conf.broker_commit_interval


def test_prices_come_from_json_text_or_a_file_and_a_bad_table_says_why(tmp_path: Path) -> None:
    table = '{"deepseek/*": {"from": "2025-01-01", "input": "0.28", "output": "0.42"}}'
    assert prices_of(Settings(prices="")).entries == {}
    assert prices_of(Settings(prices=table)).price_at("deepseek", "x", 1_800_000_000_000)
    path = tmp_path / "prices.json"
    path.write_text(table)
    assert prices_of(Settings(prices=str(path))) == prices_of(Settings(prices=table))
    with pytest.raises(ConfigError, match=r"DSH_PRICES file .* cannot be read"):
        prices_of(Settings(prices=str(tmp_path / "missing.json")))
    path.write_text('{"deepseek/*": {"from": "2025-01-01", "input": "0.28"}}')
    with pytest.raises(ConfigError, match=r"DSH_PRICES\['deepseek/\*'\]\[0\] lacks 'output'"):
        prices_of(Settings(prices=str(path)))


def test_a_bad_price_table_stops_the_worker_before_it_starts() -> None:
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "processors"],
                          cwd=Path(__file__).resolve().parents[3], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "DSH_PRICES": '{"p/m": {"from": "soon"}}',
                               "DSH_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert done.returncode == 2, done.stderr
    assert "DSH_PRICES['p/m'][0] lacks 'input'" in done.stderr
