"""Stream processors: the session topic folded into derived messages, usage and fleet status.

Run a worker::

    dsh-pipeline processors --web-port 6066            # DSH_* settings as everywhere
    dsh-pipeline processors --web-port 6067            # a second worker shares the partitions

HTTP (any worker answers; per-session requests are forwarded to the owning worker)::

    GET /sessions/{id}/messages[?at_seq=N]   derived messages, now or as of event N
    GET /sessions/{id}/page                  a dashboard page's start (surface, next seq,
                                             committed offset; :mod:`.session_page`)
    GET /usage/sessions/{id}                 session usage (gen_ai.* and dsh.usage.* counts)
    GET /fleet/sessions/{id}                 session status: idle / in-turn, turn, step, ...
    GET /fleet, GET /usage/models            counters / model totals of this worker's partitions
    GET /health                              recovery progress (remaining offsets), counters,
                                             projection version and any handover held for
    GET /metrics                             counters, Prometheus text format
    GET /loop-probe                          with DSH_LOOP_PROBE=1 (benchmarks): loop lag, gc pauses
                                             and batch sizes since the last read, else null

Compacted output topics, Avro values (:mod:`pipeline.codec.outputs`, ``schemas/``; decoded,
each is the JSON object shown here, the one the HTTP API serves):

* ``<prefix>derived-messages`` (``dsh.DerivedMessageChange``): key
  ``<session>/<slot, 12 digits>``, value
  ``{"session","slot","seq","changeSeq","op":"append"|"replace","message"}``, or a tombstone
  for a slot a replace emptied (see :mod:`pipeline.core.projection`). Rebuild a conversation:
  the live slots of the session in key order, ``message`` of each (null: nothing to show).
  Once ``replay`` switched the projection to a rebuilt version, the workers publish there
  instead (each follows the pointer topic ``<prefix>projection-versions`` and holds while a
  handover is pending: :mod:`pipeline.adapters.kafka.projection_follow`).
* ``<prefix>usage`` (``dsh.UsageRecord``): keys ``session/<id>``, ``model/<provider>/<model>``,
  ``window/<granularity>/<startMs>/<provider>/<model>`` (``closed: true`` once final);
  OpenTelemetry GenAI names beside dsh's disjoint counts (see :mod:`pipeline.core.usage`;
  in Avro the dots are underscores, ``schemas/README.md``).
* ``<prefix>fleet`` (``dsh.FleetStatus``): key session id, value the session's status.

The internal ``<app id>-usage-by-model`` topic (samples and ticks) stays JSON.

Undecodable records, gaps, events that break a surface rule and events after which a
session's table records would exceed the producer's record limit go to
``<prefix>session-events.dlq`` with the original key, bytes and headers plus ``dsh.error.*``
and ``dsh.original.*`` headers (the bytes omitted when the dead letter would not fit a record:
:mod:`pipeline.adapters.kafka.dlq`).

Modules: :mod:`.app` (the faust app, built by :func:`.app.build_processors`), :mod:`.folding`
(session stage: :mod:`.planning`, the pure batch step, and the executor of its plans,
:mod:`pipeline.adapters.faust.executor`, with their table writes once per commit in
:mod:`pipeline.adapters.faust.pending`), :mod:`.aggregation` (per-model stage), :mod:`.web`
and :mod:`.session_page` (both reading through :mod:`.folded_session`), and the batching
transport in :mod:`pipeline.adapters.faust` (the session and per-model topics delivered one
fetched batch per faust event), :mod:`.runner`, :mod:`.verify` (the checks ``demo`` runs),
:mod:`pipeline.adapters.kafka.projection_follow` (which derived-messages version to publish
to), :mod:`.options`, :mod:`.counters`.

Speed (``bench/bench_processors.py``): chunks are skipped by header inside each batch, so
faust's per-record cost is paid per batch, and a session's table record is written once per
commit, so no batch waits for a broker round trip before the next one is folded.
"""
