"""Dead letters: a record that cannot be processed goes to ``<topic>.dlq`` unchanged.

The dead letter keeps the original key, value bytes and headers, and adds headers saying
why and where from (the Kafka Connect ``__connect.errors.*`` idea under dsh names):

    dsh.error.class      the error's class name (e.g. ``CodecError``)
    dsh.error.message    the reason, truncated to 1000 characters, UTF-8
    dsh.original.topic / dsh.original.partition / dsh.original.offset

The driver puts a dead letter in the same transaction that advances the inbox offset past
the bad record, so a bad record is never both skipped and lost.
"""

from __future__ import annotations

from typing import Final

from pipeline.adapters.kafka.records import Headers, InboxRecord, OutRecord
from pipeline.settings import TopicNames

ERROR_CLASS: Final = "dsh.error.class"
ERROR_MESSAGE: Final = "dsh.error.message"
ORIGINAL_TOPIC: Final = "dsh.original.topic"
ORIGINAL_PARTITION: Final = "dsh.original.partition"
ORIGINAL_OFFSET: Final = "dsh.original.offset"
DLQ_HEADERS: Final = frozenset({ERROR_CLASS, ERROR_MESSAGE, ORIGINAL_TOPIC,
                                ORIGINAL_PARTITION, ORIGINAL_OFFSET})
MAX_MESSAGE_CHARS: Final = 1000


def dead_letter(record: InboxRecord, error: BaseException) -> OutRecord:
    """The dead letter of ``record`` that failed with ``error``.

    Goes to the partition of the same number in the dlq topic when the topics are
    co-partitioned; the key is kept so tools can find a session's dead letters.
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
    return OutRecord(topic=TopicNames.dlq(record.topic), key=record.key,
                     value=record.value if record.value is not None else b"",
                     headers=headers)
