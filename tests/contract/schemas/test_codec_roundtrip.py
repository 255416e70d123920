"""encode/decode round trips: every message comes back equal, as the same canonical bytes."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.schemas import STRATEGIES, example, same_message
from trainguard.schemas import (
    MESSAGE_TYPES,
    Abort,
    Checkpoint,
    CheckpointMeta,
    Command,
    DataCursor,
    Event,
    Heartbeat,
    Lifecycle,
    Manifest,
    Restore,
    SnapshotRef,
    decode,
    encode,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@SETTINGS
@given(data=st.data())
def test_decode_inverts_encode_and_encoding_is_canonical(cls: Any, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[cls])
    encoded = encode(msg)
    decoded = decode(encoded, expect=cls)
    assert type(decoded) is cls
    assert same_message(decoded, msg)
    # Same message, same bytes; and the decoded message has exactly the original's types
    # (an int that came back as a float would encode differently).
    assert encode(msg) == encoded
    assert encode(decoded) == encoded
    assert orjson.dumps(orjson.loads(encoded), option=orjson.OPT_SORT_KEYS) == encoded


def heartbeat(**changes: Any) -> Heartbeat:
    return dataclasses.replace(
        decode(orjson.dumps(example("heartbeat")), expect=Heartbeat), **changes
    )


@pytest.mark.parametrize(
    ("loss", "wire"), [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")]
)
def test_non_finite_loss_travels_as_a_string(loss: float, wire: str) -> None:
    encoded = encode(heartbeat(loss=loss))
    assert orjson.loads(encoded)["loss"] == wire
    decoded = decode(encoded, expect=Heartbeat).loss
    assert isinstance(decoded, float)
    assert math.isnan(decoded) if math.isnan(loss) else decoded == loss


def test_equal_messages_encode_equally_whatever_the_dict_order() -> None:
    base = decode(orjson.dumps(example("checkpoint")), expect=Checkpoint)
    forward = CheckpointMeta(hyperparameters={"a": 1, "b": {"x": 1, "y": 2}}, topology={})
    backward = CheckpointMeta(hyperparameters={"b": {"y": 2, "x": 1}, "a": 1}, topology={})
    assert encode(dataclasses.replace(base, metadata=forward)) == encode(
        dataclasses.replace(base, metadata=backward)
    )


def test_integral_floats_become_ints_and_ints_in_float_fields_become_floats() -> None:
    wire = example("heartbeat") | {"step": 12.0, "ts": 5e18, "step_time_s": 1, "loss": 2}
    hb = decode(orjson.dumps(wire), expect=Heartbeat)
    assert (hb.step, type(hb.step)) == (12, int)
    assert (hb.ts, type(hb.ts)) == (5 * 10**18, int)
    assert (hb.step_time_s, type(hb.step_time_s)) == (1.0, float)
    assert (hb.loss, type(hb.loss)) == (2.0, float)
    lc = decode(orjson.dumps(example("lifecycle", kind="exited") | {"ranks": [3.0, 1]}))
    assert isinstance(lc, Lifecycle)
    assert lc.ranks == (3, 1)
    assert all(type(r) is int for r in lc.ranks)


def test_integral_floats_in_int_fields_are_written_as_ints() -> None:
    """Equal messages give equal bytes: step=3.0 equals step=3, so both encode as 3."""
    as_float = heartbeat(step=3.0)  # what an untyped caller may pass
    assert as_float == heartbeat(step=3)
    assert encode(as_float) == encode(heartbeat(step=3))
    assert b'"step":3,' in encode(as_float)


def test_int_valued_float_fields_are_written_as_floats() -> None:
    assert b'"step_time_s":2.0' in encode(heartbeat(step_time_s=2))


def test_absent_optional_properties_take_the_dataclass_defaults() -> None:
    wire = example("heartbeat", loss="nan")  # documented without the optional properties
    assert "samples" not in wire
    hb = decode(orjson.dumps(wire), expect=Heartbeat)
    assert (hb.samples, hb.step_time_s, hb.param_checksum) == (0, None, None)


def test_arrays_become_tuples_and_nested_objects_dataclasses() -> None:
    restore = decode(orjson.dumps(example("restore")), expect=Restore)
    assert isinstance(restore.target, SnapshotRef)
    assert isinstance(restore.target.cursor, DataCursor)
    manifest = decode(orjson.dumps(example("manifest")), expect=Manifest)
    assert isinstance(manifest.shards, tuple)
    assert [s.rank for s in manifest.shards] == [0, 1]
    assert manifest.metadata.hyperparameters == {"lr": 0.0003}
    assert restore.target.data_version == restore.target.cursor.data_version


def test_expect_accepts_a_class_a_tuple_or_a_union() -> None:
    data = encode(heartbeat())
    assert isinstance(decode(data, expect=Heartbeat), Heartbeat)
    assert isinstance(decode(data, expect=(Checkpoint, Heartbeat)), Heartbeat)
    assert isinstance(decode(data, expect=Event), Heartbeat)
    assert isinstance(decode(orjson.dumps(example("abort")), expect=Command), Abort)


def test_decode_reads_any_bytes_like_object() -> None:
    data = encode(heartbeat())
    assert decode(bytearray(data)) == decode(memoryview(data)) == decode(data)
