"""What the processors count: delivery outcomes, dead letters, late samples."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class DeliveryCounters:
    """Per worker, since start. Exposed on ``GET /health`` and ``GET /metrics``."""

    records: int = 0
    applied: int = 0
    chunks_skipped_undecoded: int = 0
    duplicates: int = 0
    gaps: int = 0
    dead_letters: int = 0
    dead_letters_skipped: int = 0  # read again after a crash, dead-lettered before it
    invalid_events: int = 0
    usage_samples: int = 0
    usage_duplicates: int = 0
    late_window_samples: int = 0
    windows_closed: int = 0
    derived_changes: int = 0
    steps_started: int = 0
    failed_batches: int = 0  # folding raised: offsets held back until a restart

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    def prometheus(self, prefix: str = "dsh_processors_") -> str:
        """The counters in the Prometheus text format."""
        lines = []
        for name, value in asdict(self).items():
            lines.append(f"# TYPE {prefix}{name}_total counter")
            lines.append(f"{prefix}{name}_total {value}")
        return "\n".join(lines) + "\n"
