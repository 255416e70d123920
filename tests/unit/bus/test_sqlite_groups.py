"""The embedded bus's group assignment (``trainguard.agent.bus._sqlite_groups``): round robin
deals sorted partitions to sorted members. The embedded bus itself is tested in
``tests/contract/bus``."""

from __future__ import annotations

from trainguard.agent.bus._sqlite_groups import round_robin


def test_round_robin_deals_sorted_partitions_to_sorted_members() -> None:
    shares = round_robin(
        {"m2": frozenset({"a", "b"}), "m1": frozenset({"a"})},
        {"a": 3, "b": 2, "c": 1},
    )
    assert shares == {"m1": {("a", 0), ("a", 2)}, "m2": {("a", 1), ("b", 0), ("b", 1)}}
    assert round_robin({}, {"a": 1}) == {}
