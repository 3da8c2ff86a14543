"""Options of the processors worker that are not project-wide settings."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec
from typing import Final

from pipeline.core.errors import ConfigError
from pipeline.settings import PROCESSORS_APP_NAME, Settings

# aiokafka's default fetch_max_bytes (50 MB): a fetch never waits for more than it may carry
MAX_FETCH_MIN_BYTES: Final = 52_428_800


@dataclass(frozen=True, slots=True)
class ProcessorsOptions:
    """How one processors worker runs.

    ``store`` is faust's table store: ``memory://`` keeps tables in memory and rebuilds them
    from their changelog topics on start (what tests and small deployments use); production
    uses ``rocksdb://`` (needs the ``rocksdict`` package) so a restart only reads the tail of
    each changelog. Either way the changelogs are the state; the store is a cache.
    ``stream_buffer`` is how many fetched messages (for the session topic: whole fetched
    batches) may wait for the agent before faust pauses fetching; ``producer_buffer`` how many
    table writes may wait to be sent before faust does. ``fetch_max_wait_ms`` caps how long
    the broker holds a fetch for partitions without new records: such a fetch holds back
    every busy partition of that broker until it returns (see
    :mod:`pipeline.adapters.faust.fetching`), so it is short. Measured at 5,000 events/s
    (3 runs each): 5 ms gave p50 11-13 ms and p99 43-71 ms
    from append to derived change, 20 ms p50 15-29 and p99 67-95; it costs ~10% more CPU
    under load, and an idle worker used 3.7 CPU-seconds per 30 s against 2.9.
    ``fetch_min_bytes``: the broker answers a fetch once this much is ready (or the wait
    above passed). With 1 byte every record that arrived was answered at once, ~430 fetches/s
    at 5,000 events/s, each with a handful of records that the worker then folded, sent and
    acknowledged as one batch per partition; the per-batch work was most of the worker's CPU.
    8 KB made that ~160 fetches/s and cut the worker's CPU at 5,000 events/s from ~60% of a
    core to ~36% (p50 +1-2 ms, p99 unchanged on a quiet machine; 2 runs each of
    ``bench/bench_processors.py``; docs/decisions/benchmark-notes-sessions-5-9.md). A backlog
    is fetched in full-size fetches either way.
    ``freeze_gc`` freezes the surviving objects once a tick (:func:`.app.freeze_survivors`).
    ``loop_probe``: run :class:`pipeline.adapters.loop_probe.LoopProbe` (the benchmarks turn it
    on with ``DSH_LOOP_PROBE=1``, which the CLI reads).
    ``heal_span_max``: how far back (in offsets of the session's partition) a worker reads
    the log to heal a session whose state is behind it (:mod:`.folding`); a session whose
    missing records lie further back is reported as a gap instead.
    """

    web_port: int = 6066
    web_host: str = "127.0.0.1"
    store: str = "memory://"
    standby_replicas: int = 1
    grace_ms: int = 5_000
    tick_interval_s: float = 1.0
    active_within_ms: int = 60_000
    session_timeout_s: float = 10.0
    stream_buffer: int = 8
    producer_buffer: int = 5_000
    fetch_max_wait_ms: int = 5
    fetch_min_bytes: int = 8_192
    freeze_gc: bool = True
    heal_span_max: int = 10_000_000
    loop_probe: bool = False   # the benchmarks' loop-lag probe, GET /loop-probe (DSH_LOOP_PROBE)
    data_dir: str = ".cache/state/processors"
    app_name: str = PROCESSORS_APP_NAME

    def __post_init__(self) -> None:
        if not 0 < self.web_port < 65536:
            raise ConfigError(f"processors web port must be 1..65535, got {self.web_port}")
        if self.grace_ms < 0:
            raise ConfigError(f"usage window grace must be >= 0 ms, got {self.grace_ms}")
        if self.tick_interval_s <= 0:
            raise ConfigError(f"tick interval must be > 0 s, got {self.tick_interval_s}")
        if self.session_timeout_s < 6:
            raise ConfigError(f"consumer session timeout must be >= 6 s (the broker's "
                              f"group.min.session.timeout.ms), got {self.session_timeout_s}")
        if self.stream_buffer < 1:
            raise ConfigError(f"stream buffer must be >= 1 message, got {self.stream_buffer}")
        if not 0 < self.fetch_max_wait_ms <= 1500:
            raise ConfigError(f"fetch max wait must be 1..1500 ms, got {self.fetch_max_wait_ms}")
        if not 0 < self.fetch_min_bytes <= MAX_FETCH_MIN_BYTES:
            raise ConfigError(f"fetch min bytes must be 1..{MAX_FETCH_MIN_BYTES}, got "
                              f"{self.fetch_min_bytes}")
        if self.heal_span_max < 1:
            raise ConfigError(f"heal span must be >= 1 offset, got {self.heal_span_max}")
        if self.producer_buffer < 1:
            raise ConfigError(f"producer buffer must be >= 1 record, got {self.producer_buffer}")
        if not self.store.startswith(("memory://", "rocksdb://")):
            raise ConfigError(f"table store must be memory:// or rocksdb://, got {self.store!r}")
        if self.store.startswith("rocksdb://") and find_spec("rocksdict") is None:
            raise ConfigError("table store rocksdb:// needs the rocksdict package "
                              "(pip install rocksdict); or use memory://")

    def app_id(self, settings: Settings) -> str:
        """The faust app id (= consumer group id and changelog topic prefix)."""
        return settings.processors_group(self.app_name)

    def usage_topic(self, settings: Settings) -> str:
        """The internal topic repartitioning usage samples by provider/model."""
        return f"{self.app_id(settings)}-usage-by-model"
