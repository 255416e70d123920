"""The version rule: unknown type or major raises; a newer minor is read tolerantly (unknown
properties dropped, also in nested objects); the same minor is read strictly."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.support.schemas import example
from trainguard.schemas import (
    Checkpoint,
    Heartbeat,
    Manifest,
    Restore,
    SchemaViolation,
    UnknownSchema,
    decode,
)


def raw(wire: dict[str, Any]) -> bytes:
    return orjson.dumps(wire)


def with_additions(wire: dict[str, Any]) -> dict[str, Any]:
    """``wire`` with properties a newer minor version might add, at every level."""
    wire = wire | {"added_in_1_1": {"anything": [1, 2]}}
    if "cursor" in wire:
        wire["cursor"] = wire["cursor"] | {"shuffle_buffer": 1024}
    if "metadata" in wire:
        wire["metadata"] = wire["metadata"] | {"optimizer_version": "2"}
    for shard in wire.get("shards", []):
        shard["compression"] = "zstd"
    return wire


@pytest.mark.parametrize(
    ("type_name", "cls"),
    [("heartbeat", Heartbeat), ("checkpoint", Checkpoint), ("manifest", Manifest)],
)
def test_a_newer_minor_drops_what_this_build_does_not_know(type_name: str, cls: type[Any]) -> None:
    original = decode(raw(example(type_name)), expect=cls)
    newer = with_additions(example(type_name)) | {"schema": f"{type_name}/1.7"}
    assert decode(raw(newer), expect=cls) == original


def test_a_newer_minor_still_validates_what_this_build_knows() -> None:
    newer = example("heartbeat") | {"schema": "heartbeat/1.7", "added": 1, "step": -1}
    with pytest.raises(SchemaViolation) as info:
        decode(raw(newer))
    assert info.value.field == "step"
    missing = example("heartbeat") | {"schema": "heartbeat/1.7"}
    del missing["phase"]
    with pytest.raises(SchemaViolation) as info:
        decode(raw(missing))
    assert info.value.field == "phase"


@pytest.mark.parametrize("where", ["top", "cursor", "metadata", "shard"])
def test_the_same_minor_rejects_unknown_properties_at_every_level(where: str) -> None:
    wire = example("manifest")
    target = {
        "top": wire,
        "cursor": wire["cursor"],
        "metadata": wire["metadata"],
        "shard": wire["shards"][1],
    }[where]
    target["surprise"] = True
    with pytest.raises(SchemaViolation) as info:
        decode(raw(wire))
    prefix = {"top": "", "cursor": "cursor.", "metadata": "metadata.", "shard": "shards[1]."}[where]
    assert info.value.field == prefix + "surprise"


def test_a_newer_restore_drops_what_this_build_does_not_know_in_its_target_too() -> None:
    original = decode(raw(example("restore")), expect=Restore)
    newer = example("restore") | {"schema": "restore/2.4", "priority": "high"}
    newer["target"] = with_additions(newer["target"])
    assert decode(raw(newer), expect=Restore) == original

    # The same minor is strict inside the target as at the top.
    same = example("restore")
    same["target"]["surprise"] = True
    with pytest.raises(SchemaViolation) as info:
        decode(raw(same))
    assert info.value.field == "target.surprise"


def test_a_restore_of_the_previous_major_is_not_read() -> None:
    """``restore/1`` carried the whole manifest; this build reads only references."""
    with pytest.raises(UnknownSchema):
        decode(raw(example("restore") | {"schema": "restore/1.2"}))


@pytest.mark.parametrize("tag", ["heartbeat/2.0", "heartbeat/0.3", "gradient/1.0"])
def test_an_unknown_major_or_type_is_never_read_tolerantly(tag: str) -> None:
    with pytest.raises(UnknownSchema):
        decode(raw(example("heartbeat") | {"schema": tag}))
