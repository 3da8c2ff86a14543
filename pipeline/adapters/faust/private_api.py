"""Every private name of faust-streaming and aiokafka the project relies on (and of the queue
class faust's changelog queue is, mode's ``ThrowableQueue``, an ``asyncio.Queue``).

Rules:

- Private attributes and methods of the two libraries are reached only through the
  functions of this module, from anywhere in ``pipeline/`` (the batching transport, and the
  Kafka adapter's few reaches into aiokafka); the private methods overridden or called are
  listed by :func:`overridden` with the parameters expected, the private attributes by
  :func:`attributes`.
- :func:`private_api_problems` checks both lists against the installed libraries and names
  every missing or changed attribute or signature; the worker refuses to start on any
  (:func:`require_supported_faust`), and ``tests/adapters/test_faust_private_api.py`` fails on them
  (and on a private name of another library's object used anywhere else in ``pipeline/``),
  so an upgrade of either library fails loudly, here, and not as a silent change of what
  is committed.
- faust (and mode) is imported only when a faust name is checked or reached: the driver and
  the CLI use the aiokafka accessors without loading faust.
- One faust build is supported: with its Cython stream iterator (the two iterators count
  acks differently, see docs/decisions/processors-transport.md). :func:`faust_build_problem`
  says when the other one is in use (``NO_CYTHON`` set, or a build without the extension).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import sys
from collections import deque
from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any, Final

import aiokafka.client as aiokafka_client
import aiokafka.consumer.consumer as aiokafka_consumer_module
import aiokafka.consumer.fetcher as aiokafka_fetcher
import aiokafka.consumer.subscription_state as aiokafka_subscriptions
import aiokafka.producer.producer as aiokafka_producer
import aiokafka.producer.transaction_manager as aiokafka_transactions

SUPPORTED_VERSIONS: Final = {"faust-streaming": "0.15.3", "aiokafka": "0.14.0"}


@functools.cache
def overridden() -> tuple[tuple[type, str, tuple[str, ...]], ...]:
    """(class, method, parameter names after self) of every private (or non-API) method
    overridden or called; a change of any of them changes what it is called with. Each
    line says why no public API does it."""
    faust_aiokafka, faust_consumer, faust_tables = (_faust("transport.drivers.aiokafka"),
                                                    _faust("transport.consumer"),
                                                    _faust("tables.base"))
    return (
        # faust builds its consumer thread here only; no setting names the thread class.
        (faust_aiokafka.Consumer, "_new_consumer_thread", ()),
        # Where fetched records become messages: no hook regroups a fetch into batches.
        (faust_consumer.Consumer, "_wait_next_records", ("timeout",)),
        # faust's recovery seek (public name, internal use): no hook runs after it.
        (faust_consumer.Consumer, "perform_seek", ()),
        # faust's gap bookkeeping has no switch; batches would rebuild its tree per batch.
        (faust_consumer.Consumer, "_add_gap", ("tp", "offset_from", "offset_to")),
        # faust's commit entry (public name, internal use): no before-commit hook exists.
        (faust_consumer.Consumer, "force_commit", ("topics", "start_new_transaction")),
        # faust's rebalance handlers (public names, internal use): app.on_partitions_assigned
        # is a signal sent after table recovery started, too late (docs/decisions).
        (faust_consumer.Consumer, "on_partitions_assigned", ("assigned", "generation_id")),
        (faust_consumer.Consumer, "on_partitions_revoked", ("revoked",)),
        # What faust commits per partition: no public policy for it.
        (faust_consumer.Consumer, "_new_offset", ("tp",)),
        # Whether the broker took a commit: faust's public commit() hides it.
        (faust_consumer.Consumer, "_commit_offsets", ("offsets", "start_new_transaction")),
        # How a record becomes a faust message: no factory setting (and the read offset,
        # cleared there for a batch).
        (faust_consumer.Consumer, "_to_message", ("tp", "record")),
        # faust's fetch, run on its consumer thread: no hook around aiokafka's getmany.
        (faust_aiokafka.AIOKafkaConsumerThread, "_fetch_records",
         ("consumer", "active_partitions", "timeout", "max_records")),
        # faust passes no fetch options to aiokafka: the consumer is built here with them.
        (faust_aiokafka.AIOKafkaConsumerThread, "_create_worker_consumer", ("transport",)),
        # faust's seek on its consumer thread (public name): aiokafka's seek must run there.
        (faust_aiokafka.AIOKafkaConsumerThread, "seek_wait", ("partitions",)),
        # Every buffered table write (public name, internal use): no producer hook sees them.
        (faust_aiokafka.Producer, "send_soon", ("fut",)),
        # The producer's settings: faust has no option for idempotence (acks=all, no duplicates
        # on a retried send).
        (faust_aiokafka.Producer, "_settings_extra", ()),
        # faust's per-write producer lookup: no setting skips its start-up guard.
        (_faust("topics").Topic, "_get_producer", ()),
        # Where an acknowledged table write moves the store's changelog offset, and where a
        # recovery or standby read applies changelog records (public name, internal use):
        # no hook for either (adapters/faust/tables.py, a changelog with two writers).
        (faust_tables.Collection, "_on_changelog_sent", ("fut",)),
        (faust_tables.Collection, "apply_changelog_batch", ("batch",)),
        # The table's own key normalisation of changelog keys, as its stores apply them.
        (faust_tables.Collection, "_to_key", ("k",)),
        # A wait for newly buffered records that is not a hand-out: aiokafka's public getmany
        # waits *inside* the hand-out, where a concurrent seek would fake a batch's span.
        (aiokafka_fetcher.Fetcher, "_create_fetch_waiter", ()),
        # A changelog topic built again once the table's key serializer is raw (faust builds
        # it in the table's constructor, with JSON keys); no setting passes the serializer.
        (faust_tables.Collection, "_new_changelog_topic", ("retention", "compacting",
                                                           "deleting")),
        # faust's changelog queue (public names, internal use): faust clears it on every resume
        # of its flow control, also after the standby reads started; no setting keeps what
        # they fetched (adapters/faust/changelog_queue.py).
        (_faust("tables.manager").TableManager, "changelog_queue", ()),
        (_throwable_queue(), "clear", ()),
        # The partition the producer gives a key (its partitioner with the topic's metadata):
        # a bulk send groups records by partition before sending (adapters/kafka/topic_scan).
        (aiokafka_producer.AIOKafkaProducer, "_partition",
         ("topic", "partition", "key", "value", "serialized_key", "serialized_value")),
        # A wait for one topic's metadata: the public partitions_for() does it too but
        # returns only the numbers, after the same wait (the bulk send needs the wait alone).
        (aiokafka_client.AIOKafkaClient, "_wait_on_metadata", ("topic",)),
    )

@functools.cache
def attributes() -> tuple[tuple[type, str], ...]:
    """(class, attribute) of every private attribute read or written: each must be
    assigned as ``self.<attribute>`` somewhere in the class or its bases. Why each is
    needed:"""
    faust_consumer = _faust("transport.consumer")
    return (
        # faust drops messages below it; it is set inside its hand-over loop, no API clears it.
        (faust_consumer.Consumer, "_read_offset"),
        # faust's own committed offsets (what it seeked to, what it commits from); aiokafka's
        # committed() asks the broker, which does not know faust's refused-commit overwrite.
        (faust_consumer.Consumer, "_committed_offset"),
        # Acks faust's Cython iterator records for batched partitions: no API drops them.
        (faust_consumer.Consumer, "_acked"),
        (faust_consumer.Consumer, "_acked_index"),
        # aiokafka's fetcher: positions, reassignment and the fetch waiter are only there.
        (aiokafka_consumer_module.AIOKafkaConsumer, "_fetcher"),
        # The subscription state: positions read synchronously (public position() awaits).
        (aiokafka_fetcher.Fetcher, "_subscriptions"),
        # Whether a fetch wait ended because the fetcher closed: no public flag.
        (aiokafka_fetcher.Fetcher, "_closed"),
        # Not a consumer option (AIOKafkaConsumer does not pass it to its Fetcher).
        (aiokafka_fetcher.Fetcher, "_prefetch_backoff"),
        # The fetch options of a running consumer (the idle pace): aiokafka takes them only
        # in its constructor, and its fetcher reads these for every fetch it sends.
        (aiokafka_fetcher.Fetcher, "_fetch_max_wait_ms"),
        (aiokafka_fetcher.Fetcher, "_fetch_min_bytes"),
        (aiokafka_fetcher.Fetcher, "_fetcher_timeout"),
        # The consumer's client: a metadata request for named topics only, without creating
        # them (adapters/kafka/assigned); the public API asks for every topic's metadata.
        (aiokafka_consumer_module.AIOKafkaConsumer, "_client"),
        # Whether a transactional producer is in a fatal state (an abort would raise again).
        (aiokafka_producer.AIOKafkaProducer, "_txn_manager"),
        # faust's changelog queue (mode's ThrowableQueue, an asyncio.Queue): its records, the
        # puts waiting for room and the errors thrown into it; no API clears some records only.
        (_throwable_queue(), "_queue"),
        (_throwable_queue(), "_putters"),
        (_throwable_queue(), "_errors"),
    )

@functools.cache
def members() -> tuple[tuple[type, str], ...]:
    """Public members of private objects, read through the functions below."""
    return (
        (aiokafka_subscriptions.SubscriptionState, "subscription"),
        (aiokafka_subscriptions.SubscriptionState, "reassignment_in_progress"),
        (aiokafka_subscriptions.SubscriptionState, "wait_for_assignment"),
        (aiokafka_subscriptions.Assignment, "state_value"),
        (aiokafka_subscriptions.TopicPartitionState, "has_valid_position"),
        (aiokafka_subscriptions.TopicPartitionState, "position"),
        (_faust("transport.producer").Producer, "flush"),
        (aiokafka_transactions.TransactionManager, "is_fatal_error"),
    )


def _faust(module: str) -> Any:
    return importlib.import_module(f"faust.{module}")


def _throwable_queue() -> Any:
    """mode's queue class, faust's changelog queue (imported when checked, as faust is)."""
    return importlib.import_module("mode.utils.queues").ThrowableQueue


def private_api_problems() -> list[str]:
    """Every listed name missing from the installed libraries or changed, one line each."""
    problems = [problem for cls, name, params in overridden()
                if (problem := _signature_problem(cls, name, params)) is not None]
    problems += [f"{_name(cls)}.{name}: not assigned as self.{name} any more"
                 for cls, name in attributes() if not _assigns(cls, name)]
    problems += [f"{_name(cls)}.{name}: missing" for cls, name in members()
                 if not hasattr(cls, name)]
    return problems


def faust_build_problem() -> str | None:
    """Why the faust build in use is not the supported one (None: it is)."""
    if getattr(_faust("streams"), "_CStreamIterator", None) is None:
        return ("faust-streaming runs without its Cython stream iterator (NO_CYTHON is set, "
                "or the build lacks faust._cython.streams); the processors' transport is "
                "built and tested on the Cython one: unset NO_CYTHON or install the wheel")
    return None


def require_supported_faust() -> None:
    """Raise RuntimeError naming every problem of :func:`private_api_problems` and
    :func:`faust_build_problem` (the worker calls this before it builds its transport)."""
    problems = private_api_problems()
    build = faust_build_problem()
    if build is not None:
        problems.append(build)
    if problems:
        raise RuntimeError(
            "the installed faust-streaming/aiokafka do not match what the processors' "
            f"transport relies on (built for {SUPPORTED_VERSIONS}): " + "; ".join(problems))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _signature_problem(cls: type, name: str, params: tuple[str, ...]) -> str | None:
    method = getattr(cls, name, None)
    if method is None:
        return f"{_name(cls)}.{name}: missing"
    try:
        found = tuple(inspect.signature(method).parameters)[1:]
    except (TypeError, ValueError):
        return None   # a compiled method: its signature cannot be read
    if found != params:
        return f"{_name(cls)}.{name}: parameters {found}, expected {params}"
    return None


def _assigns(cls: type, attribute: str) -> bool:
    """Whether ``self.<attribute>`` is assigned in the module of ``cls`` or of a base."""
    needles = (f"self.{attribute} =", f"self.{attribute}: ")
    for base in cls.__mro__:
        source = _module_source(base.__module__)
        if any(needle in source for needle in needles):
            return True
    return False


@functools.cache
def _module_source(module: str) -> str:
    try:
        path = inspect.getsourcefile(sys.modules[module])
    except (KeyError, TypeError):
        return ""
    try:
        return Path(path).read_text() if path else ""
    except OSError:
        return ""


# faust's consumer (a BatchingConsumer) ------------------------------------------------

def committed_offsets(consumer: Any) -> MutableMapping[Any, int | None]:
    """faust's committed offset per partition (what it seeked to, or last committed)."""
    offsets: MutableMapping[Any, int | None] = consumer._committed_offset
    return offsets


def clear_read_offset(consumer: Any, tp: Any) -> None:
    """Make faust accept any offset of ``tp`` at the next hand-over (its read offset)."""
    consumer._read_offset[tp] = None


def forget_acks(consumer: Any, tp: Any) -> None:
    """Drop faust's acks of ``tp`` (acked by a previous generation)."""
    consumer._acked.pop(tp, None)
    consumer._acked_index.pop(tp, None)


def forget_acks_below(consumer: Any, tp: Any, committed: int) -> None:
    """Drop faust's acks of ``tp`` below the committed offset."""
    done = {last for last in consumer._acked[tp] if last < committed}
    if done:
        consumer._acked[tp] = [last for last in consumer._acked[tp] if last not in done]
        consumer._acked_index[tp].difference_update(done)


# aiokafka's consumer and fetcher ------------------------------------------------------

def set_prefetch_backoff(consumer: Any, seconds: float) -> None:
    """How long aiokafka holds a broker's next fetch while fetched records wait untaken."""
    consumer._fetcher._prefetch_backoff = seconds


def set_fetch_pace(fetcher: Any, *, max_wait_ms: int, min_bytes: int,
                   routine_poll_s: float) -> None:
    """The fetch options of the next fetches aiokafka sends (and how often its fetch
    routine looks for one to send)."""
    fetcher._fetch_max_wait_ms = max_wait_ms
    fetcher._fetch_min_bytes = min_bytes
    fetcher._fetcher_timeout = routine_poll_s


def fetcher_of(consumer: Any) -> Any:
    return consumer._fetcher


def fetcher_closed(fetcher: Any) -> bool:
    return bool(fetcher._closed)


async def wait_for_reassignment(fetcher: Any, timeout: float) -> bool:
    """Until a reassignment in progress (if any) is done (True), for at most ``timeout``
    seconds (False: still in progress). Raises what aborted it (a fatal group error)."""
    subscriptions = fetcher._subscriptions
    if not subscriptions.reassignment_in_progress:
        return True
    waiter = subscriptions.wait_for_assignment()
    done, _ = await asyncio.wait([waiter], timeout=max(timeout, 0.0))
    if not done:
        waiter.cancel()   # aiokafka resolves only the waiters not done yet
        return False
    waiter.result()
    return True


def positions(fetcher: Any, tps: Iterable[Any]) -> dict[Any, int | None]:
    """aiokafka's position of each of ``tps`` that is assigned (None: not yet known)."""
    subscription = fetcher._subscriptions.subscription
    assignment = subscription.assignment if subscription is not None else None
    if assignment is None:
        return {}
    found: dict[Any, int | None] = {}
    for tp in tps:
        state = assignment.state_value(tp)
        if state is not None:
            found[tp] = state.position if state.has_valid_position else None
    return found


def fetch_waiter(fetcher: Any) -> Any:
    """A future done when aiokafka buffered new records (or its fetch routine failed)."""
    return fetcher._create_fetch_waiter()


def names() -> Iterable[str]:
    """Every listed name, for messages and docs."""
    yield from (f"{_name(cls)}.{name}" for cls, name, _ in overridden())
    yield from (f"{_name(cls)}.{name}" for cls, name in attributes() + members())


# faust's tables ---------------------------------------------------------------------

def rebuild_changelog_topic(table: Any) -> Any:
    """The table's changelog topic built again (after its key serializer changed)."""
    return table._new_changelog_topic()


def queued_items(queue: Any) -> deque[Any]:
    """The records in faust's changelog queue, oldest first (mutable in place)."""
    items: deque[Any] = queue._queue
    return items


def clear_thrown(queue: Any) -> None:
    """Drop the errors thrown into faust's changelog queue (as its clear does)."""
    queue._errors.clear()


def wake_putters(queue: Any) -> None:
    """Wake every put waiting for room in the queue: each puts its record if there is room
    now, or waits again (asyncio's put checks again)."""
    putters = queue._putters
    while putters:
        putter = putters.popleft()
        if not putter.done():
            putter.set_result(None)


# aiokafka's client and producer (adapters/kafka) --------------------------------------

def client_of(consumer: Any) -> Any:
    """The aiokafka client of a consumer."""
    return consumer._client


def key_partition(producer: Any, topic: str, key: bytes | None, value: bytes | None) -> int:
    """The partition the producer's partitioner gives ``key`` (metadata of ``topic`` known)."""
    partition: int = producer._partition(topic, None, key, value, key, value)
    return partition


async def wait_on_metadata(producer: Any, topic: str) -> None:
    """Until the producer's client has metadata for ``topic``."""
    await producer.client._wait_on_metadata(topic)


def transaction_failed_fatally(producer: Any) -> bool:
    """Whether a transactional producer is in a fatal state (nothing more to abort)."""
    return bool(producer._txn_manager.is_fatal_error())
