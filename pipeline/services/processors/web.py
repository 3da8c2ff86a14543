"""HTTP views of the processors worker (faust's aiohttp web server).

Per-session views are routed by faust to the worker that owns the session's partition
(``table_route``), so any worker answers for every session:

    GET /sessions/{id}/messages[?at_seq=N]   derived messages (now, or as of event N: read
                                             back from the session topic, see
                                             :func:`messages_at`)
    GET /sessions/{id}/page                  where a dashboard session page starts: the
                                             live surface, the next seq and the committed
                                             offset after which the rest follows (503
                                             when the worker cannot vouch for it; see
                                             :mod:`.session_page`)
    GET /fleet/sessions/{id}                 one session's fleet status
    GET /usage/sessions/{id}                 one session's usage (OTel names + dsh counts)
    GET /fleet                               counters over the sessions this worker owns
    GET /usage/models                        model totals this worker owns
    GET /health                              recovery progress (remaining offsets), counters,
                                             projection version and any handover held for
    GET /metrics                             the counters and gauges (prometheus_client)
    GET /loop-probe                          with DSH_LOOP_PROBE=1 (benchmarks): loop lag, gc pauses
                                             and batch sizes since the last read, else null
"""

from __future__ import annotations

import logging
from typing import Any

from faust.web import View
from prometheus_client import generate_latest

from pipeline.adapters.kafka.session_history import read_surface_events
from pipeline.core.errors import BrokerError, CodecError, EventError
from pipeline.core.surface import SurfaceFold
from pipeline.core.usage import session_record
from pipeline.services.processors.folded_session import (
    current_state,
    expected_seq,
    surface_nodes,
)
from pipeline.services.processors.metrics import processors_registry
from pipeline.services.processors.session_page import session_page
from pipeline.services.processors.worker import Processors

log = logging.getLogger(__name__)


def session_messages(processors: Processors, session_id: str) -> dict[str, Any] | None:
    """The derived messages of a session as folded so far (None: session unknown here).

    Read between two awaits of the folds, so the surface and the ``nodes`` it names agree
    (a fold records a node, for the next persist, before it awaits anything)."""
    return _folded_messages(processors, session_id)[0]


def _folded_messages(processors: Processors, session_id: str
                     ) -> tuple[dict[str, Any] | None, list[int]]:
    """:func:`session_messages`, and the surface seqs whose node the table lacks."""
    tables, folder = processors.tables, processors.folder
    state = current_state(tables, folder, session_id)
    next_seq = expected_seq(tables, folder, session_id, state)
    if state is None and next_seq == 0:
        return None, []
    messages, missing = [], []
    found = surface_nodes(tables, folder, state, state.partition) if state is not None else []
    for seq, node in found:
        if node is None:
            missing.append(seq)
        elif node.get("message") is not None:
            messages.append(node["message"])
    return ({"session": session_id, "nextSeq": next_seq, "atSeq": next_seq - 1,
             "messages": messages}, missing)


async def messages_now(processors: Processors, session_id: str) -> dict[str, Any] | None:
    """:func:`session_messages`; when the ``nodes`` table lacks a message the session's
    surface names (the worker's state disagrees with the log), the answer is read back from
    the log instead, as for ``?at_seq=``, counted (``nodes_missing``) and logged."""
    now, missing = _folded_messages(processors, session_id)
    return None if now is None else await _latest(processors, session_id, now, missing)


async def _latest(processors: Processors, session_id: str, now: dict[str, Any],
                  missing: list[int]) -> dict[str, Any]:
    if not missing:
        return now
    processors.counters.nodes_missing += len(missing)
    log.warning("session %s: the nodes table lacks the messages of surface seqs %s: answered "
                "from the log", session_id, missing[:20])
    return await _read_back_messages(processors, session_id, now["atSeq"], now)


async def messages_at(processors: Processors, session_id: str, at_seq: int
                      ) -> dict[str, Any] | None:
    """The derived messages as of event ``at_seq`` (None: session unknown here).

    The current ones when ``at_seq`` is the last event folded or later; otherwise read back
    from the session topic (from the offset of the session's first event) and folded by
    core's surface fold: the worker keeps no history of the surface."""
    now, missing = _folded_messages(processors, session_id)
    if now is None:
        return None
    if at_seq >= now["nextSeq"] - 1:
        return await _latest(processors, session_id, now, missing)
    return await _read_back_messages(processors, session_id, at_seq, now)


async def _read_back_messages(processors: Processors, session_id: str, at_seq: int,
                              now: dict[str, Any]) -> dict[str, Any]:
    """The messages as of event ``at_seq``, read back from the session topic."""
    state = current_state(processors.tables, processors.folder, session_id)
    if state is None or at_seq < 0 or processors.decode is None:
        return {**now, "atSeq": max(at_seq, -1), "messages": []}
    events = await read_surface_events(
        processors.settings, processors.settings.topics.session_events, state.partition,
        session_id, state.first_offset, at_seq, processors.decode)
    fold = SurfaceFold()
    for event in events:
        fold.apply(event)
    return {**now, "atSeq": at_seq, "messages": list(fold.messages())}


def _at_seq(request: Any) -> int | None:
    raw = request.query.get("at_seq")
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"at_seq must be an integer, got {raw[:40]!r}") from None
    if value < -1:
        raise ValueError(f"at_seq must be >= -1, got {value}")
    return value


def register_views(processors: Processors) -> None:
    tables = processors.tables

    async def messages(view: Any, request: Any, session_id: str) -> Any:
        try:
            at_seq = _at_seq(request)
        except ValueError as exc:
            return view.error(400, str(exc))
        try:
            body = (await messages_now(processors, session_id) if at_seq is None
                    else await messages_at(processors, session_id, at_seq))
        except (BrokerError, CodecError, EventError) as exc:
            return view.error(503, f"reading the session back failed: {exc}")
        if body is None:
            return view.error(404, f"session {session_id[:200]!r} is unknown")
        return view.json(body)

    async def page(view: Any, request: Any, session_id: str) -> Any:
        body, reason = session_page(processors, session_id)
        if body is None:
            return view.error(503, reason)
        return view.json(body)

    async def fleet_session(view: Any, request: Any, session_id: str) -> Any:
        state = current_state(processors.tables, processors.folder, session_id)
        if state is None:
            return view.error(404, f"session {session_id[:200]!r} is unknown")
        return view.json(state.to_json()["fleet"])

    async def usage_session(view: Any, request: Any, session_id: str) -> Any:
        state = current_state(processors.tables, processors.folder, session_id)
        if state is None:
            return view.error(404, f"session {session_id[:200]!r} is unknown")
        return view.json(session_record(session_id, state.usage.totals))

    _routed(processors, "/sessions/{session_id}/messages", tables.sessions, messages)
    _routed(processors, "/sessions/{session_id}/page", tables.sessions, page)
    _routed(processors, "/fleet/sessions/{session_id}", tables.sessions, fleet_session)
    _routed(processors, "/usage/sessions/{session_id}", tables.sessions, usage_session)
    _register_worker_views(processors)


def _routed(processors: Processors, path: str, table: Any, handler: Any) -> None:
    """A GET view answered by the worker owning ``session_id`` (faust forwards otherwise)."""
    app = processors.app
    route = app.table_route(table=table, match_info="session_id")

    async def get(view: Any, request: Any, session_id: str) -> Any:
        return await handler(view, request, session_id)

    view_class = type(f"View{handler.__name__.title()}", (View,), {"get": route(get)})
    app.page(path, name=handler.__name__)(view_class)


def _register_worker_views(processors: Processors) -> None:
    app = processors.app
    registry = processors_registry(processors)

    async def fleet(web: Any, request: Any) -> Any:
        sessions = {s.session_id: s.to_json() for s in processors.local_fleet()}
        return web.json({"counters": processors.fleet_summary(), "sessions": sessions})

    async def usage_models(web: Any, request: Any) -> Any:
        aggregator = processors.aggregator
        return web.json({"models": aggregator.model_records() if aggregator else []})

    async def health(web: Any, request: Any) -> Any:
        follow = processors.follow
        return web.json({"recovery": processors.recovery(),
                         "counters": processors.counters.to_json(),
                         "partitions": sorted(processors.active_partitions(
                             processors.settings.topics.session_events)),
                         "projection": follow.status() if follow is not None else None})

    async def metrics(web: Any, request: Any) -> Any:
        return web.text(generate_latest(registry).decode("utf-8"),
                        content_type="text/plain; version=0.0.4")

    async def loop_probe(web: Any, request: Any) -> Any:
        # the benchmarks' probe (DSH_LOOP_PROBE=1): what it saw since the last read
        probe = processors.loop_probe
        return web.json(probe.window() if probe is not None else None)

    for path, handler in (("/fleet", fleet), ("/usage/models", usage_models),
                          ("/health", health), ("/metrics", metrics),
                          ("/loop-probe", loop_probe)):
        app.page(path)(handler)
