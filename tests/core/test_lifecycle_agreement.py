"""The four readers of a turn's lifecycle agree with the one fold at every event.

The same event sequences (the recorded session logs, and generated valid logs) go through
:class:`~pipeline.core.lifecycle.Lifecycle`, :class:`~pipeline.core.turns.TurnState`, the fleet
row (:class:`~pipeline.core.fleet.FleetStatus`), the GenAI trace fold
(:class:`~pipeline.core.genai_spans.SessionTraces`) and the dashboard's live tail
(:class:`~pipeline.services.dashboard.model.FleetModel`); after every event each says the same
about the turn and the step (open or closed, which number) and how the last turn ended.
Plain data: no broker.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from shared_paths import SHARED_DIR
from strategies import valid_logs

from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import Event, Replace
from pipeline.core.fleet import IN_TURN, FleetStatus
from pipeline.core.genai_spans import SessionTraces
from pipeline.core.lifecycle import TURN_END, Lifecycle, end_reason_kind
from pipeline.core.turns import TurnState
from pipeline.services.dashboard.model import FleetModel

SAMPLES = sorted((Path(__file__).resolve().parents[2] / "samples/sessions").glob("*.jsonl"))
FIXTURES = sorted((SHARED_DIR / "fixtures").glob("**/*.jsonl"))
SESSION = "s"


@dataclass(frozen=True, slots=True)
class View:
    """What one reader says after an event: (turn open, turn number), (step open, step
    number), and the kind of the turn that just ended (None after any other event)."""

    turn: tuple[bool, int | None]
    step: tuple[bool, int | None]
    ended: str | None


@dataclass(slots=True)
class Readers:
    """The fold and its four readers, fed the same events."""

    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    turns: TurnState = field(default_factory=TurnState)
    fleet: FleetStatus = field(default_factory=lambda: FleetStatus(SESSION))
    traces: SessionTraces = field(default_factory=lambda: SessionTraces(SESSION))
    dashboard: FleetModel = field(default_factory=FleetModel)

    def feed(self, event: Event, position: int) -> dict[str, View]:
        ended = event.type == TURN_END
        self.lifecycle = self.lifecycle.advance(event)
        self.turns = self.turns.advance(event)
        self.fleet.apply(event)
        closed = self.traces.add(event, position)
        before = self._dashboard_ends()
        self.dashboard.apply_event(SESSION, event)
        return {"lifecycle": _fold_view(self.lifecycle, ended),
                "turns": _fold_view(self.turns, ended),
                "fleet": self._fleet_view(ended),
                "trace": self._trace_view(closed.end if closed is not None else None),
                "dashboard": self._dashboard_view(before)}

    def _fleet_view(self, ended: bool) -> View:
        in_turn = self.fleet.state == IN_TURN
        return View((in_turn, self.fleet.turn if in_turn else None),
                    (self.fleet.step is not None, self.fleet.step),
                    self.fleet.last_end_reason if ended else None)

    def _trace_view(self, end: object) -> View:
        turn = self.traces.open
        open_steps = [s.number for s in (turn.steps.values() if turn else ()) if s.end_ms is None]
        return View((turn is not None, turn.turn if turn else None),
                    (bool(open_steps), max(open_steps, default=None)), end_reason_kind(end))

    def _dashboard_ends(self) -> dict[str, float]:
        """The turns ended so far by kind, summed over the dashboard's time buckets."""
        ends: dict[str, float] = {}
        for sums in self.dashboard.end_reasons.buckets.values():
            for kind, count in sums.items():
                ends[kind] = ends.get(kind, 0.0) + count
        return ends

    def _dashboard_view(self, before: dict[str, float]) -> View:
        """The dashboard times an open turn and step (their start times; no numbers), and
        counts a turn's end under its kind."""
        timing = self.dashboard.timing[SESSION]
        after = self._dashboard_ends()
        grew = [key for key, value in after.items() if value != before.get(key, 0.0)]
        turn_open = timing.turn_started_ms is not None
        step_open = timing.step_started_ms is not None  # a recorded time may be 0
        return View((turn_open, self.lifecycle.turn if turn_open else None),
                    (step_open, self.lifecycle.step if step_open else None),
                    grew[0] if grew else None)


def _fold_view(state: Lifecycle, ended: bool) -> View:
    return View((state.in_turn, state.turn), (state.in_step, state.step),
                state.last_end_kind if ended else None)


def _disagreements(events: list[Event]) -> Iterator[str]:
    readers = Readers()
    for position, event in enumerate(events):
        views = readers.feed(event, position)
        reference = views.pop("lifecycle")
        for name, view in views.items():
            if view != reference:
                yield f"after seq {event.seq} ({event.type}): {name} {view} != {reference}"


@pytest.mark.parametrize("path", SAMPLES + FIXTURES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_readers_agree_on_a_recorded_log_at_every_event(path: Path) -> None:
    events = list(read_session_file(path).events)
    assert any(e.type == TURN_END for e in events)  # a log with a turn, or nothing is tested
    assert list(_disagreements(events)) == []


def test_the_recorded_logs_are_there() -> None:
    assert len(SAMPLES) >= 6 and len(FIXTURES) >= 5


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_logs())
def test_readers_agree_on_generated_logs_at_every_event(events: list[Event]) -> None:
    assert list(_disagreements(events)) == []


def test_a_pruning_rewrite_opens_no_step_in_the_trace() -> None:
    """A pruning tool/result rewrites an older turn's result: the current turn's trace gets
    no chat or tool span for it (it used to open a step the older turn had named)."""
    events = [Event("turn/start", 0, 1, {"turn": 1}),
              Event("step/start", 1, 2, {"turn": 1, "step": 1}),
              Event("step/end", 2, 3, {"turn": 1, "step": 1}),
              Event("turn/end", 3, 4, {"turn": 1, "reason": {"kind": "completed"}}),
              Event("turn/start", 4, 5, {"turn": 2}),
              Event("tool/result", 5, 6, {"turn": 1, "step": 2, "message": {
                  "role": "user", "content": [{"type": "tool-result", "toolCallId": "c1",
                                               "content": []}]}}, surface_op=Replace(0, 0))]
    assert list(_disagreements(events)) == []
