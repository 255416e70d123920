"""Key to partition mapping shared by both adapters.

The embedded bus uses the same function as Kafka's default partitioner (murmur2 of the key's
UTF-8 bytes, sign bit cleared, modulo the partition count; ``DefaultPartitioner`` in the Java
client and in aiokafka), so a job id maps to the same partition number on either bus.
"""

from __future__ import annotations

from functools import lru_cache

from aiokafka.partitioner import murmur2

__all__ = ["partition_for"]


@lru_cache(maxsize=65536)
def partition_for(key: str, partitions: int) -> int:
    """Partition (0 <= p < ``partitions``) of records with ``key``."""
    hashed: int = murmur2(key.encode())
    return (hashed & 0x7FFFFFFF) % partitions
