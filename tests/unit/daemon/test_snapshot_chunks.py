"""Snapshots in chunks (:mod:`trainguard.daemon.service._snapshot_chunks`): any envelope cut at
any limit joins back to the same bytes and opens to the same state; every chunk missing,
altered, truncated or taken from another snapshot, a stale head, and a forged, foreign or
malformed head is refused with its reason, and the loader's rule (:func:`plan_partition`) falls
back on it."""

from __future__ import annotations

import math
import struct
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import structs

from tests.support.machine_scenarios import JOB, Sim, config, running_job
from tests.support.snapshot_keys import Keys, make_keys
from trainguard.daemon.core._state import JobState, new_job
from trainguard.daemon.service._snapshot_chunks import (
    HEAD_CONTEXT,
    HEAD_FORMAT,
    chunk_job,
    chunk_key,
    head_of,
    join,
    open_record,
    read_record_header,
    split,
)
from trainguard.daemon.service._snapshot_envelope import (
    Round,
    SnapshotRefused,
    fold_config_id,
    read_header,
    seal,
)
from trainguard.daemon.service._snapshot_store import Fallback, Rebuild, plan_partition

KEYS = make_keys(1)
OTHER = make_keys(2)
CFG = config()


def sealed(
    state: JobState, offset: int = 118, jobs: tuple[str, ...] = (), keys: Keys = KEYS
) -> bytes:
    return seal(
        state,
        Round.of(2, offset, {state.job_id, *jobs}),
        signing_kid=keys.signing_kid,
        signing_key=keys.signing,
        data_kid=keys.data_kid,
        data_key=keys.data_key,
        nonce=bytes(range(12)),
        config=CFG,
        version="9.9.9",
    )


def opened(head: bytes, chunks: dict[str, bytes], *, job: str = JOB, keys: Keys = KEYS) -> Any:
    return open_record(head, chunks, keys.verify, keys.data, job, fold_config=fold_config_id(CFG))


def refused(head: bytes, chunks: dict[str, bytes], **kwargs: Any) -> SnapshotRefused:
    with pytest.raises(SnapshotRefused) as caught:
        opened(head, chunks, **kwargs)
    return caught.value


@pytest.fixture(scope="module")
def big() -> JobState:
    """A 32-rank job with committed checkpoints: an envelope of several kB."""
    state, _ = running_job(Sim(world_size=32), 25)
    return state


LIMIT = 1000


@pytest.fixture(scope="module")
def cut(big: JobState) -> tuple[bytes, bytes, dict[str, bytes]]:
    """``big``'s envelope, its head and its chunks at :data:`LIMIT`."""
    envelope = sealed(big)
    head, chunks = split(envelope, LIMIT, KEYS.signing)
    assert len(chunks) >= 3
    return envelope, head, dict(chunks)


ENVELOPE = sealed(structs.replace(new_job(JOB), phase="running", clock_ns=5))


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, len(ENVELOPE) + 50))
def test_any_envelope_cut_at_any_limit_joins_back_to_itself(limit: int) -> None:
    head, chunks = split(ENVELOPE, limit, KEYS.signing)
    values = [value for _, value in chunks]
    assert b"".join(values) == ENVELOPE
    assert len(chunks) == math.ceil(len(ENVELOPE) / limit)
    assert all(0 < len(v) <= limit for v in values)
    assert max(map(len, values)) - min(map(len, values)) <= len(values)  # spread evenly
    header = read_header(ENVELOPE)
    assert [key for key, _ in chunks] == [
        chunk_key(JOB, header.offset, i) for i in range(len(chunks))
    ]
    assert {chunk_job(key) for key, _ in chunks} == {JOB}
    parsed = head_of(head)
    assert parsed is not None
    assert parsed.header == header
    assert (parsed.size, len(parsed.chunks)) == (len(ENVELOPE), len(chunks))
    assert join(parsed, dict(chunks)) == ENVELOPE
    assert opened(head, dict(chunks))[1].clock_ns == 5


def test_a_snapshot_in_chunks_opens_to_its_state(
    big: JobState, cut: tuple[bytes, bytes, dict[str, bytes]]
) -> None:
    envelope, head, chunks = cut
    header, state = opened(head, chunks)
    assert state == big
    assert header == read_header(envelope)
    assert read_record_header(head)[0] == header
    assert read_record_header(envelope) == (header, None)
    assert len(head) < 700 + 80 * len(chunks), "the head holds a header and digests, no state"
    # An envelope under a job's key opens without chunks, as it always did.
    assert opened(envelope, {})[1] == big
    # Chunks of other jobs or snapshots on the partition are ignored.
    other_head, other_chunks = split(sealed(big, offset=99), LIMIT, KEYS.signing)
    assert opened(head, {**chunks, **dict(other_chunks)})[1] == big
    assert opened(other_head, {**chunks, **dict(other_chunks)})[0].offset == 99


def test_chunk_keys_are_never_job_ids() -> None:
    assert chunk_job(chunk_key("job-1.a_b", 118, 3)) == "job-1.a_b"
    for key in ("job-1", "job-1/chunk/1", "job-1/chunk/x/1", "job-1/g0/s10", "/chunk/1/1"):
        assert chunk_job(key) is None, key


def test_a_missing_chunk_is_refused(cut: tuple[bytes, bytes, dict[str, bytes]]) -> None:
    _, head, chunks = cut
    second = chunk_key(JOB, 118, 1)
    exc = refused(head, {k: v for k, v in chunks.items() if k != second})
    assert exc.code == "chunk_missing"
    assert f"chunk 2 of {len(chunks)}" in exc.reason
    assert refused(head, {}).code == "chunk_missing"


@pytest.mark.parametrize("change", ["flip", "truncate", "extend", "swap", "other_snapshot"])
def test_an_altered_chunk_is_refused(
    big: JobState, cut: tuple[bytes, bytes, dict[str, bytes]], change: str
) -> None:
    _, head, chunks = cut
    first, second = chunk_key(JOB, 118, 0), chunk_key(JOB, 118, 1)
    value = chunks[second]
    if change == "flip":
        altered = {second: value[:10] + bytes([value[10] ^ 0x40]) + value[11:]}
    elif change == "truncate":
        altered = {second: value[:-1]}
    elif change == "extend":
        altered = {second: value + b"\0"}
    elif change == "swap":
        altered = {first: chunks[second], second: chunks[first]}
    else:  # the same chunk of another snapshot of the job at the same offset (another nonce)
        again = seal(
            big,
            Round.of(2, 118, [JOB]),
            signing_kid=KEYS.signing_kid,
            signing_key=KEYS.signing,
            data_kid=KEYS.data_kid,
            data_key=KEYS.data_key,
            nonce=bytes(12),
            config=CFG,
            version="9.9.9",
        )
        altered = {second: dict(split(again, LIMIT, KEYS.signing)[1])[second]}
    exc = refused(head, {**chunks, **altered})
    assert exc.code == "chunk_corrupt"
    assert "chunk 1 of" in exc.reason if change == "swap" else "chunk 2 of" in exc.reason


def test_a_stale_head_is_refused(big: JobState, cut: tuple[bytes, bytes, dict[str, bytes]]) -> None:
    """A head older than the chunks on the bus: its own chunks were replaced by tombstones (a
    newer offset), or rewritten under the same keys (a newer snapshot at the same offset)."""
    _, head, chunks = cut
    newer_head, newer = split(sealed(big, offset=200), LIMIT, KEYS.signing)
    assert opened(newer_head, dict(newer))[0].offset == 200
    assert refused(head, dict(newer)).code == "chunk_missing"
    rewritten = sealed(structs.replace(big, clock_ns=big.clock_ns + 1))
    _, same_keys = split(rewritten, LIMIT, KEYS.signing)
    assert set(dict(same_keys)) <= set(chunks)
    assert refused(head, dict(same_keys)).code == "chunk_corrupt"


def resigned_head(head: bytes, change: dict[str, Any], keys: Keys = KEYS) -> bytes:
    (size,) = struct.unpack_from(">I", head)
    fields = {**orjson.loads(head[4 : 4 + size]), **change}
    raw = orjson.dumps(
        {k: v for k, v in fields.items() if v is not None}, option=orjson.OPT_SORT_KEYS
    )
    signed = struct.pack(">I", len(raw)) + raw
    return signed + keys.signing.sign(HEAD_CONTEXT + signed)


def test_a_forged_foreign_or_malformed_head_is_refused(
    big: JobState, cut: tuple[bytes, bytes, dict[str, bytes]]
) -> None:
    envelope, head, chunks = cut
    flipped = head[:-1] + bytes([head[-1] ^ 1])
    assert refused(flipped, chunks).code == "bad_signature"
    assert refused(head, chunks, keys=OTHER).code == "unknown_kid"
    assert refused(head, chunks, job="another").code == "wrong_job"
    # Signed as an envelope, not as a head: the contexts differ.
    as_envelope = head[:-64] + KEYS.signing.sign(b"trainguard-snapshot/2\x00" + head[:-64])
    assert refused(as_envelope, chunks).code == "bad_signature"
    assert opened(resigned_head(head, {}), chunks)[1] == big
    header = read_header(envelope).to_dict()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"chunks": []}, "malformed"),
        ({"chunks": [[0, "00" * 32]]}, "malformed"),
        ({"chunks": [["1", "00" * 32]]}, "malformed"),
        ({"chunks": [[1, "XY" * 32]]}, "malformed"),
        ({"bytes": 1}, "malformed"),
        ({"sha256": "00"}, "malformed"),
        ({"sha256": None}, "malformed"),
        ({"extra": 1}, "malformed"),
        ({"snapshot": {**header, "offset": -1}}, "malformed"),
        ({"snapshot": {**header, "format": "trainguard-snapshot/1"}}, "malformed"),
        ({"snapshot": {**header, "format": "trainguard-snapshot/9"}}, "format"),
        ({"sha256": "00" * 32}, "chunk_corrupt"),  # each chunk right, the whole not
        ({"snapshot": {**header, "offset": 119}}, "chunk_missing"),  # keys derived from it
    ]
    for change, code in cases:
        assert refused(resigned_head(head, change), chunks).code == code, change
    # A head of another format version is no head: refused as a record of unknown format.
    assert refused(resigned_head(head, {"format": "trainguard-snapshot-head/2"}), chunks).code == (
        "format"
    )
    assert HEAD_FORMAT == "trainguard-snapshot-head/1"


def test_a_head_whose_envelope_has_another_header_is_refused(big: JobState) -> None:
    """Only a signing-key holder could make one; still never opened as the head says."""
    envelope = sealed(big)
    head, chunks = split(envelope, LIMIT, KEYS.signing)
    other = read_header(sealed(big, jobs=("b",))).to_dict()
    exc = refused(resigned_head(head, {"snapshot": other}), dict(chunks))
    assert exc.code == "malformed"
    assert "not its head's" in exc.reason


def test_split_refuses_a_bad_limit() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        split(ENVELOPE, 0, KEYS.signing)


# -- the loader's rule with chunks ---------------------------------------------------------------


def plan(values: dict[str, bytes], committed: int = 1000) -> Any:
    return plan_partition(2, values, KEYS, fold_config=fold_config_id(CFG), committed=committed)


def test_a_round_with_a_job_in_chunks_is_rebuilt(big: JobState) -> None:
    small = structs.replace(new_job("b"), phase="running", clock_ns=9)
    head, chunks = split(sealed(big, jobs=("b",)), LIMIT, KEYS.signing)
    leftover = {chunk_key(JOB, 50, 0): b"an older snapshot's chunk, not yet tombstoned"}
    result = plan({JOB: head, **dict(chunks), "b": sealed(small, jobs=(JOB,)), **leftover})
    assert isinstance(result, Rebuild)
    assert result.states == {JOB: big, "b": small}
    assert result.covered == {JOB: 118, "b": 118}
    assert plan(dict(chunks)) is None, "chunks without a head are no snapshot"


@pytest.mark.parametrize(("drop", "reason"), [(True, "chunk_missing"), (False, "chunk_corrupt")])
def test_a_bad_chunk_makes_the_partition_fall_back(big: JobState, drop: bool, reason: str) -> None:
    head, chunks = split(sealed(big), LIMIT, KEYS.signing)
    values = {JOB: head, **dict(chunks)}
    last = chunks[-1][0]
    if drop:
        del values[last]
    else:
        values[last] = values[last][::-1]
    result = plan(values)
    assert isinstance(result, Fallback)
    assert (result.reason, result.job) == (reason, JOB)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=70),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=6,
)
HEAD, CHUNKS = split(ENVELOPE, 300, KEYS.signing)
HEAD_FIELDS = sorted(orjson.loads(HEAD[4 : 4 + struct.unpack_from(">I", HEAD)[0]]))


def head_with(field: str, value: Any) -> bytes:
    """:data:`HEAD` with ``field`` set to ``value``, signed again."""
    return resigned_head(HEAD, {field: value})


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=300) | st.builds(head_with, st.sampled_from(HEAD_FIELDS), json_values)
)
def test_no_record_value_breaks_the_loader(data: bytes) -> None:
    """Whatever a job's key holds (any bytes, or a validly signed head with any field set to
    any JSON value), opening it returns a state or refuses it: no other error escapes."""
    try:
        opened(data, dict(CHUNKS))
    except SnapshotRefused:
        return
