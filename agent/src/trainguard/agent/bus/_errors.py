"""Errors raised by the bus adapters: one base, subclasses named for the condition."""

from __future__ import annotations

__all__ = [
    "BusClosed",
    "BusError",
    "BusURLError",
    "BusUnavailable",
    "DeliveryFailed",
    "Fenced",
    "TransactionExpired",
    "TransactionInDoubt",
]


class BusError(Exception):
    """Base of every error the bus raises.

    Attributes:
        retriable: whether the same call may succeed if tried again later.
    """

    retriable: bool = False


class BusURLError(BusError, ValueError):
    """The bus URL is not ``sqlite:///path`` or ``kafka://host:port[,host:port...]``."""


class BusUnavailable(BusError, TimeoutError):
    """The bus could not be reached within the configured time (broker down, bad address)."""

    retriable = True


class DeliveryFailed(BusError):
    """A record could not be made durable (timeout, broker error, too large).

    Args:
        message: what failed.
        in_doubt: see the attribute.

    Attributes:
        in_doubt: the record may still be appended later (Kafka: the idempotent producer keeps
            retrying it after its waiter gave up, or the broker's answer was lost). A caller
            that sends it again while the same producer lives may append it twice; when false,
            the record was not appended.
    """

    retriable = True

    def __init__(self, message: str, *, in_doubt: bool = False) -> None:
        super().__init__(message)
        self.in_doubt = in_doubt


class BusClosed(BusError):
    """The bus or consumer was used after ``close()``."""


class Fenced(BusError):
    """A :class:`~trainguard.agent.bus.PartitionWriter` lost its partition to a newer owner
    (Kafka: another producer initialised the same transactional id, ``ProducerFenced`` /
    ``INVALID_PRODUCER_EPOCH``; embedded bus: the member's lease ended or it rejoined its group),
    or (Kafka) failed with another fatal error, which the message names. Nothing it sent after
    its last successful commit is ever visible. Not retriable: the writer is dead; a new one may
    be opened only once the consumer group assigns the partition again (opening one earlier
    would fence the new owner).
    """


class TransactionExpired(Fenced):
    """Kafka: the writer's transaction stayed open longer than ``transaction.timeout.ms`` (its
    owner paused, or the broker away for that long), so the coordinator aborted it and bumped
    the producer epoch. The writer is as dead as a fenced one (aiokafka reports the bump as
    ``ProducerFenced``, which is why the writer tells the two apart by the age of its open
    transaction), but no newer owner need exist: the caller gets a fresh assignment (rejoins
    its group) rather than waiting for a rebalance that may never come.
    """


class TransactionInDoubt(BusError):
    """A :meth:`~trainguard.agent.bus.PartitionWriter.commit` (or abort) was neither
    confirmed nor refused within the bus's send timeout: the transaction may yet commit or
    abort. Retriable, but not by this writer: the caller closes it and opens a new one, whose
    opening settles the transaction on the bus, and only then reads the committed position
    again (and rebuilds from it).
    """

    retriable = True
