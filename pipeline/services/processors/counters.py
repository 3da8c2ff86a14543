"""What the processors count: delivery outcomes, dead letters, late samples.

Plain integers, incremented where the thing happens (no lock, no registry on the hot path);
:mod:`.metrics` reads them at each scrape. Each field's ``help`` is its ``# HELP`` text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


def _counted(help_text: str) -> int:
    return field(default=0, metadata={"help": help_text})


@dataclass(slots=True)
class DeliveryCounters:
    """Per worker, since start. Exposed on ``GET /health`` and ``GET /metrics``."""

    records: int = _counted("Session-topic records consumed")
    applied: int = _counted("Events applied to the session folds")
    chunks_skipped_undecoded: int = _counted("Assistant chunks admitted without decoding them")
    duplicates: int = _counted("Events seen again (a seq already folded) and ignored")
    gaps: int = _counted("Seq gaps found (reported, the session waits)")
    sessions_healed: int = _counted(
        "Gaps between a worker's state and a valid log healed by reading the log back")
    records_healed: int = _counted("Records read back from the log and folded by a heal")
    nodes_missing: int = _counted(
        "Surface messages the nodes table lacked when a view read them (answered from the log)")
    dead_letters: int = _counted("Records sent to the dead-letter topic")
    dead_letters_skipped: int = _counted(
        "Records read again after a crash that were dead-lettered before it")
    invalid_events: int = _counted("Events the fold refused (a rule broken)")
    usage_samples: int = _counted("Usage samples produced from step ends")
    usage_duplicates: int = _counted("Usage samples seen again and ignored")
    late_window_samples: int = _counted("Usage samples after their windows closed")
    windows_closed: int = _counted("Usage windows closed")
    derived_changes: int = _counted("Derived-message changes written")
    steps_started: int = _counted("step/start events applied")
    # folding raised: offsets held back until a restart
    failed_batches: int = _counted("Batches whose folding failed (offsets held back)")

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @staticmethod
    def help_texts() -> dict[str, str]:
        """Each counter's name and its ``# HELP`` text, in declaration order."""
        return {f.name: f.metadata["help"] for f in fields(DeliveryCounters)}
