"""Dead letters: a record that cannot be processed goes to ``<topic>.dlq`` unchanged.

The dead letter keeps the original key, value bytes and headers, and adds headers saying
why and where from (the Kafka Connect ``__connect.errors.*`` idea under dsh names):

    dsh.error.class      the error's class name (e.g. ``CodecError``)
    dsh.error.message    the reason, truncated to 1000 characters, UTF-8
    dsh.original.topic / dsh.original.partition / dsh.original.offset
    dsh.original.omitted only when the value could not be kept (below)

A record close to the record limit (``DSH_MAX_RECORD_BYTES``; sized as the broker counts it,
:func:`~pipeline.adapters.kafka.records.record_bytes`) would be refused as a dead letter (the
headers above make it larger), and a refused dead letter holds back the offset of what it
stands for (the driver's transaction, the processors' commit) for good. Such a dead
letter keeps everything but the value, says so in ``dsh.original.omitted`` (the value's
size), and names where the value still is: the original topic, partition and offset.

The driver puts a dead letter in the same transaction that advances the inbox offset past
the bad record, so a bad record is never both skipped and lost.
"""

from __future__ import annotations

from typing import Final

from pipeline.adapters.kafka.records import Headers, InboxRecord, OutRecord, record_bytes
from pipeline.settings import TopicNames

ERROR_CLASS: Final = "dsh.error.class"
ERROR_MESSAGE: Final = "dsh.error.message"
ORIGINAL_TOPIC: Final = "dsh.original.topic"
ORIGINAL_PARTITION: Final = "dsh.original.partition"
ORIGINAL_OFFSET: Final = "dsh.original.offset"
ORIGINAL_OMITTED: Final = "dsh.original.omitted"
DLQ_HEADERS: Final = frozenset({ERROR_CLASS, ERROR_MESSAGE, ORIGINAL_TOPIC,
                                ORIGINAL_PARTITION, ORIGINAL_OFFSET, ORIGINAL_OMITTED})
MAX_MESSAGE_CHARS: Final = 1000
MAX_RECORD_BYTES: Final = 1_000_000   # faust's producer_max_request_size; aiokafka's is 1 MiB


def dead_letter(record: InboxRecord, error: BaseException,
                max_record_bytes: int = MAX_RECORD_BYTES) -> OutRecord:
    """The dead letter of ``record`` that failed with ``error``.

    Goes to the partition of the same number in the dlq topic when the topics are
    co-partitioned; the key is kept so tools can find a session's dead letters. Without
    its value when it would not fit ``max_record_bytes`` (see the module doc).
    """
    message = str(error) or type(error).__name__
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    original: Headers = tuple(h for h in record.headers if h[0] not in DLQ_HEADERS)
    headers: Headers = (*original,
                        (ERROR_CLASS, type(error).__name__.encode()),
                        (ERROR_MESSAGE, message.encode("utf-8")),
                        (ORIGINAL_TOPIC, record.topic.encode("utf-8")),
                        (ORIGINAL_PARTITION, str(record.partition).encode()),
                        (ORIGINAL_OFFSET, str(record.offset).encode()))
    value = record.value if record.value is not None else b""
    if record_bytes(record.key, value, headers) > max_record_bytes:
        headers = (*headers, (ORIGINAL_OMITTED, f"{len(value)} bytes".encode()))
        value = b""
    return OutRecord(topic=TopicNames.dlq(record.topic), key=record.key, value=value,
                     headers=headers)
