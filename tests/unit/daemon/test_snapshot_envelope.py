"""The snapshot envelope (``trainguard-snapshot/2``): a sealed state opens to exactly that state
with its header, compressed before it is encrypted, and every alteration, wrong key, unknown key
id, foreign job, other layout or other configuration is refused with its reason; an envelope of
the earlier uncompressed format still opens; the loader's rule for a partition's set of
snapshots (:func:`plan_partition`) takes only complete rounds."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import orjson
import pytest
import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import structs

from tests.support.machine_scenarios import (
    JOB,
    Sim,
    actions,
    config,
    healthy_traces,
    killed_job,
    play,
    run,
    running_job,
)
from tests.support.snapshot_keys import Keys, make_keys, rotated
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._state import JobPhase, JobState, new_job
from trainguard.daemon.core._state_codec import LAYOUT, decode_state, encode_state
from trainguard.daemon.service._snapshot_envelope import (
    FORMAT,
    FORMAT_V1,
    SIGNING_CONTEXT,
    Round,
    SnapshotRefused,
    fold_config_id,
    open_snapshot,
    read_header,
    seal,
)
from trainguard.daemon.service._snapshot_store import Fallback, Rebuild, plan_partition

KEYS = make_keys(1)
OTHER = make_keys(2)
CFG = config()
NONCE = bytes(range(12))


def sealed(
    state: JobState,
    *,
    keys: Keys = KEYS,
    partition: int = 2,
    offset: int = 118,
    jobs: tuple[str, ...] = (),
    cfg: Any = CFG,
    nonce: bytes = NONCE,
) -> bytes:
    return seal(
        state,
        Round.of(partition, offset, {state.job_id, *jobs}),
        signing_kid=keys.signing_kid,
        signing_key=keys.signing,
        data_kid=keys.data_kid,
        data_key=keys.data_key,
        nonce=nonce,
        config=cfg,
        version="9.9.9",
    )


def opened(data: bytes, *, keys: Keys = KEYS, job: str = JOB, cfg: Any = CFG) -> Any:
    return open_snapshot(data, keys.verify, keys.data, job, fold_config=fold_config_id(cfg))


def refused(data: bytes, **kwargs: Any) -> SnapshotRefused:
    with pytest.raises(SnapshotRefused) as caught:
        opened(data, **kwargs)
    return caught.value


def flip(data: bytes, index: int, bit: int = 0) -> bytes:
    changed = bytearray(data)
    changed[index] ^= 1 << bit
    return bytes(changed)


def regions(data: bytes) -> dict[str, range]:
    """Byte ranges of the envelope's parts."""
    (size,) = struct.unpack_from(">I", data)
    header_end = 4 + size
    return {
        "length": range(0, 4),
        "header": range(4, header_end),
        "nonce": range(header_end, header_end + 12),
        "ciphertext": range(header_end + 12, len(data) - 64 - 16),
        "tag": range(len(data) - 64 - 16, len(data) - 64),
        "signature": range(len(data) - 64, len(data)),
    }


def resigned(data: bytes, header: dict[str, Any], keys: Keys = KEYS) -> bytes:
    """``data`` with its header replaced by ``header`` and signed again with ``keys`` (the
    ciphertext left as it is): what only the holder of the signing key can make."""
    parts = regions(data)
    raw = orjson.dumps(header, option=orjson.OPT_SORT_KEYS)
    body = data[parts["nonce"].start : parts["signature"].start]
    signed = struct.pack(">I", len(raw)) + raw + body
    return signed + keys.signing.sign(SIGNING_CONTEXT + signed)


def header_of(data: bytes) -> dict[str, Any]:
    where = regions(data)["header"]
    return dict(orjson.loads(data[where.start : where.stop]))


@pytest.fixture(scope="module")
def restoring() -> JobState:
    """A 4-rank job with three committed snapshots, restoring after rank 1 was killed."""
    _, state, _ = killed_job()
    return state


def test_a_sealed_state_opens_to_exactly_that_state(restoring: JobState) -> None:
    data = sealed(restoring, jobs=("b", "c"))
    header, state = opened(data)
    assert state == restoring
    assert header.job_id == JOB
    assert (header.partition, header.offset, header.round_jobs) == (2, 118, 3)
    assert header.round == Round.of(2, 118, [JOB, "b", "c"])
    assert (header.signing_kid, header.data_kid) == (KEYS.signing_kid, KEYS.data_kid)
    assert header.created_ns == restoring.clock_ns, "the state's clock, not a wall clock"
    assert (header.format, header.layout, header.trainguard) == (FORMAT, LAYOUT, "9.9.9")
    assert header.fold_config == fold_config_id(CFG)
    assert (header.compression, header.state_bytes) == ("zstd", len(encode_state(restoring)))
    assert read_header(data) == header
    # The state is encrypted: none of its strings is readable in the record.
    assert b"restoring" not in data
    assert restoring.committed[-1].snapshot_id.encode() not in data
    # Same inputs, same bytes (Ed25519 signatures are deterministic); a new nonce changes all.
    assert sealed(restoring, jobs=("b", "c")) == data
    other = sealed(restoring, jobs=("b", "c"), nonce=bytes(12))
    where = regions(data)["ciphertext"]
    assert other[where.start : where.stop] != data[where.start : where.stop]
    assert opened(other)[1] == restoring


@pytest.mark.parametrize("part", ["header", "nonce", "ciphertext", "tag", "signature"])
def test_a_flipped_bit_anywhere_is_refused_by_the_signature(restoring: JobState, part: str) -> None:
    data = sealed(restoring)
    where = regions(data)[part]
    if part == "header":
        # Inside the round digest's hex digits: the header stays valid JSON.
        header = data[where.start : where.stop]
        index = where.start + header.index(b'"round_digest":"') + 20
        changed = flip(data, index, 0)
        assert orjson.loads(changed[where.start : where.stop])
    else:
        changed = flip(data, (where.start + where.stop) // 2, 3)
    assert refused(changed).code == "bad_signature"


SMALL = sealed(structs.replace(new_job(JOB), phase="running", clock_ns=5))


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, 10**9), bit=st.integers(0, 7))
def test_no_single_bit_flip_opens(position: int, bit: int) -> None:
    exc = refused(flip(SMALL, position % len(SMALL), bit))
    assert exc.code in {"malformed", "format", "unknown_kid", "bad_signature"}


def test_a_truncated_or_extended_record_is_refused(restoring: JobState) -> None:
    data = sealed(restoring)
    assert refused(data[:-1]).code == "bad_signature"
    assert refused(data + b"\0").code == "bad_signature"
    assert refused(data[:50]).code == "malformed"
    assert refused(b"").code == "malformed"
    assert refused(struct.pack(">I", 2**31) + data[4:]).code == "malformed"


def test_the_wrong_signing_key_is_refused(restoring: JobState) -> None:
    """Another key under the id the reader knows: the signature fails."""
    impostor = dataclasses.replace(
        OTHER, signing_kid=KEYS.signing_kid, data_kid=KEYS.data_kid, data_key=KEYS.data_key
    )
    exc = refused(sealed(restoring, keys=impostor))
    assert exc.code == "bad_signature"
    assert KEYS.signing_kid in exc.reason


def test_a_validly_signed_snapshot_whose_data_key_differs_fails_its_tag(
    restoring: JobState,
) -> None:
    """The reader's data key under the header's id is not the writer's: the GCM tag fails."""
    reader = dataclasses.replace(KEYS, data={KEYS.data_kid: OTHER.data_key})
    exc = refused(sealed(restoring), keys=reader)
    assert exc.code == "tag"


def test_unknown_key_ids_are_refused_by_name(restoring: JobState) -> None:
    data = sealed(restoring, keys=OTHER)
    exc = refused(data)
    assert exc.code == "unknown_kid"
    assert OTHER.signing_kid in exc.reason
    only_verify = dataclasses.replace(KEYS, verify={**KEYS.verify, **OTHER.verify})
    exc = refused(data, keys=only_verify)
    assert exc.code == "unknown_kid"
    assert OTHER.data_kid in exc.reason
    assert str(exc).startswith("unknown_kid: ")


def test_another_jobs_snapshot_under_this_jobs_key_is_refused(restoring: JobState) -> None:
    """A valid snapshot of job ``victim`` published under key ``job``: refused, not loaded."""
    victim = structs.replace(restoring, job_id="victim")
    exc = refused(sealed(victim), job=JOB)
    assert exc.code == "wrong_job"
    assert "victim" in exc.reason


def test_a_state_of_another_layout_or_configuration_is_refused(
    restoring: JobState, monkeypatch: pytest.MonkeyPatch
) -> None:
    stricter = config(heartbeat_timeout_s=6.0)
    assert refused(sealed(restoring, cfg=stricter)).code == "config"
    # daemon_id is no part of the fold: a daemon with another id reads the snapshot.
    header, state = opened(sealed(restoring, cfg=dataclasses.replace(CFG, daemon_id="another")))
    assert state == restoring
    assert header.config_id != header.fold_config
    # Without an expected configuration (inspection tools) it is not checked.
    open_snapshot(sealed(restoring, cfg=stricter), KEYS.verify, KEYS.data, JOB)

    monkeypatch.setattr("trainguard.daemon.service._snapshot_envelope.LAYOUT", "0" * 16)
    old_build = sealed(restoring)
    monkeypatch.undo()
    exc = refused(old_build)
    assert exc.code == "layout"


OLD_BUILD = Path(__file__).with_name("data") / "jobstate-c35900be070fb0d2.json"
"""A restoring 2-rank job's state as the build before the bus-outage rule encoded it."""


def test_a_snapshot_written_before_the_outage_rule_opens_with_its_fields_at_their_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The build before wrote state layout c35900be070fb0d2, and its default configuration had
    no ``bus_gap_s``, ``outage_settle_s`` or ``loss_spike_false_alarm``, so its ``fold_config``
    was 043cc3e3c7a1e8fc: this build opens such a snapshot instead of folding the log again."""
    assert fold_config_id(CFG) == "043cc3e3c7a1e8fc"
    assert fold_config_id(config(bus_gap_s=4.0)) != fold_config_id(CFG)
    assert fold_config_id(config(loss_spike_false_alarm=1e-6)) != fold_config_id(CFG)
    old = OLD_BUILD.read_bytes()
    state = decode_state(old)
    monkeypatch.setattr("trainguard.daemon.service._snapshot_envelope.LAYOUT", "c35900be070fb0d2")
    monkeypatch.setattr("trainguard.daemon.service._snapshot_envelope.encode_state", lambda _: old)
    written = sealed(state)
    monkeypatch.undo()
    header, back = opened(written)
    assert header.layout == "c35900be070fb0d2"
    assert back == state
    assert (back.phase, back.settle_until_ns, back.held) == ("restoring", None, None)


def test_the_state_is_compressed_before_it_is_encrypted() -> None:
    """A state of many ranks (repeated field names, host names, URIs) takes a fraction of its
    document's size: compressing after encryption would gain nothing."""
    state, _ = running_job(Sim(world_size=64), 25)
    document = encode_state(state)
    data = sealed(state)
    assert len(data) < len(document) / 3
    assert opened(data)[1] == state


def test_another_format_and_malformed_headers_are_refused(restoring: JobState) -> None:
    data = sealed(restoring)
    header = header_of(data)
    assert refused(resigned(data, {**header, "format": "trainguard-snapshot/3"})).code == "format"
    # A /2 header without the fields /2 added, or a /1 header with them: malformed.
    bare = {k: v for k, v in header.items() if k not in ("compression", "state_bytes")}
    assert refused(resigned(data, bare)).code == "malformed"
    assert refused(resigned(data, {**header, "format": FORMAT_V1})).code == "malformed"
    assert refused(resigned(data, {**header, "compression": "lz4"})).code == "malformed"
    assert refused(resigned(data, {**header, "state_bytes": -1})).code == "malformed"
    assert refused(resigned(data, {k: v for k, v in header.items() if k != "offset"})).code == (
        "malformed"
    )
    assert refused(resigned(data, {**header, "offset": -1})).code == "malformed"
    assert refused(resigned(data, {**header, "offset": True})).code == "malformed"
    assert refused(resigned(data, {**header, "job_id": 7})).code == "malformed"
    assert refused(resigned(data, {**header, "extra": 1})).code == "malformed"
    # A header changed and signed again no longer matches the GCM associated data.
    assert refused(resigned(data, {**header, "offset": 119})).code == "tag"


def signed_body(body: bytes, **header: Any) -> bytes:
    """An envelope of ``body`` (the bytes encrypted, after any compression) under a valid
    header changed by ``header``, signed: what only a faulty writer could make."""
    fields = {**header_of(sealed(new_job(JOB))), **header}
    raw = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)
    ciphertext = AESGCM(KEYS.data_key).encrypt(NONCE, body, raw)
    signed = struct.pack(">I", len(raw)) + raw + NONCE + ciphertext
    return signed + KEYS.signing.sign(SIGNING_CONTEXT + signed)


def zstd(data: bytes, *, with_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=with_size).compress(data)


def test_a_signed_body_that_is_no_state_of_the_job_is_refused() -> None:
    """Refused as malformed, never half-read."""
    for document in (b"not a state", encode_state(new_job("someone-else"))):
        data = signed_body(zstd(document), state_bytes=len(document))
        assert refused(data).code == "malformed"


def test_a_signed_body_that_does_not_decompress_to_its_stated_size_is_refused() -> None:
    """Refused as malformed; a frame that states a size other than the header's is refused
    before anything is decompressed, one that states none is cut at the header's size."""
    document = encode_state(new_job(JOB))
    assert opened(signed_body(zstd(document), state_bytes=len(document)))[1] == new_job(JOB)
    cases = [
        (document, len(document)),  # not compressed at all
        (zstd(document), len(document) - 1),
        (zstd(document), len(document) + 1),
        (zstd(document, with_size=False), len(document) - 1),
        (zstd(document, with_size=False), len(document) + 1),
        (zstd(document)[:-3], len(document)),
    ]
    for body, size in cases:
        exc = refused(signed_body(body, state_bytes=size))
        assert exc.code == "malformed", (size, exc)
        assert "decompress" in exc.reason or "states" in exc.reason


V1 = Path(__file__).with_name("data") / "snapshot-v1.bin"
"""A ``trainguard-snapshot/1`` envelope as the build before compression wrote it: the
``restoring`` state, partition 2, offset 118, round of ``job``, ``b``, ``c``, keys of seed 1,
nonce 0..11, written by trainguard 0.1.0."""


def test_an_uncompressed_snapshot_of_the_earlier_format_still_opens(restoring: JobState) -> None:
    """A daemon upgraded in place starts from the snapshots its predecessor left (the envelope
    module says why they are read, not refused)."""
    data = V1.read_bytes()
    header, state = opened(data)
    assert state == restoring
    assert (header.format, header.compression, header.state_bytes) == (FORMAT_V1, "none", None)
    assert header.round == Round.of(2, 118, [JOB, "b", "c"])
    assert read_header(data) == header
    assert header.to_bytes() == data[4 : 4 + struct.unpack_from(">I", data)[0]]
    # Its own signing context: the same bytes under /2's are not a valid signature.
    assert refused(flip(data, len(data) - 1)).code == "bad_signature"
    with_v2_signature = data[:-64] + KEYS.signing.sign(SIGNING_CONTEXT + data[:-64])
    assert refused(with_v2_signature).code == "bad_signature"


def test_rotated_keys_open_old_and_new_snapshots(restoring: JobState) -> None:
    old = sealed(restoring)
    after = rotated(KEYS, 3)
    new = sealed(restoring, keys=after)
    assert opened(old, keys=after)[1] == restoring
    assert opened(new, keys=after)[0].signing_kid == after.signing_kid != KEYS.signing_kid
    assert refused(new).code == "unknown_kid"


def test_seal_refuses_a_bad_nonce_or_key() -> None:
    with pytest.raises(ValueError, match="nonce"):
        sealed(new_job(JOB), nonce=b"short")
    with pytest.raises(ValueError, match="32 bytes"):
        sealed(new_job(JOB), keys=dataclasses.replace(KEYS, data_key=b"k" * 16))
    with pytest.raises(ValueError, match="distinct jobs"):
        Round.of(0, 0, ["a", "a"])


# -- daemon_id never enters a state (why fold_config leaves it out) ----------------------------


@settings(max_examples=40, deadline=None)
@given(trace=healthy_traces(), steps=actions, mode=st.sampled_from(["restart", "in_process"]))
def test_the_daemon_id_never_changes_a_state(
    trace: tuple[Sim, list[Any]], steps: list[tuple[str, int, int]], mode: str
) -> None:
    """Folding one trace (a healthy start, a kill, then any interleaving of acknowledgements,
    heartbeats, exits, corrupt snapshots, finishes and ticks, so restores, resumes and aborts)
    under two daemon ids gives equal states after every input."""
    sim, healthy = trace
    one = config(restore_mode=mode)
    two = dataclasses.replace(one, daemon_id="elsewhere-42")
    state, _ = run(healthy, cfg=one)
    _, played = play(sim, state, [("exit", 0, 1), *steps], one)
    a = b = new_job(JOB)
    for item in [*healthy, *(item for item, _ in played)]:
        a, _ = decide(a, item, one)
        b, _ = decide(b, item, two)
        assert a == b
    assert fold_config_id(one) == fold_config_id(two)


# -- a partition's snapshots: only complete rounds ---------------------------------------------


def state_of(job: str, phase: JobPhase = "running", clock: int = 1) -> JobState:
    return structs.replace(new_job(job), phase=phase, clock_ns=clock)


def plan(values: dict[str, bytes], committed: int = 1000, partition: int = 2) -> Any:
    return plan_partition(
        partition, values, KEYS, fold_config=fold_config_id(CFG), committed=committed
    )


def at(offset: int, jobs: tuple[str, ...], job: str, phase: JobPhase = "running") -> bytes:
    return sealed(state_of(job, phase, offset), offset=offset, jobs=jobs)


def test_a_complete_round_starts_at_its_position() -> None:
    jobs = ("a", "b", "c")
    result = plan({j: at(100, jobs, j) for j in jobs})
    assert isinstance(result, Rebuild)
    assert result.start == 100
    assert result.covered == dict.fromkeys(jobs, 100)
    assert {j: s.clock_ns for j, s in result.states.items()} == dict.fromkeys(jobs, 100)
    assert result.newest == Round.of(2, 100, jobs)
    assert plan({}) is None


def test_a_job_left_at_an_older_round_starts_the_rebuild_there() -> None:
    """A round at 200 whose write of ``b`` failed (or found ``b`` unchanged): ``b``'s snapshot at
    100 still holds its state there; the rebuild reads from 100, skipping ``a`` and ``c`` below
    200."""
    result = plan(
        {
            "a": at(200, ("a", "b", "c"), "a"),
            "b": at(100, ("a", "b"), "b"),
            "c": at(200, ("a", "b", "c"), "c"),
        }
    )
    assert isinstance(result, Rebuild)
    assert result.start == 100
    assert result.covered == {"a": 200, "b": 100, "c": 200}


def test_finished_jobs_do_not_hold_the_start_back() -> None:
    jobs = ("a", "b", "done")
    result = plan(
        {
            "a": at(300, jobs, "a"),
            "b": at(300, jobs, "b"),
            "done": at(50, ("a", "done"), "done", phase="finished"),
        }
    )
    assert isinstance(result, Rebuild)
    assert result.start == 300
    only_ended = plan({"done": at(50, ("done",), "done", phase="failed")})
    assert isinstance(only_ended, Rebuild)
    assert only_ended.start == 50


def test_a_round_missing_a_job_falls_back_to_the_log() -> None:
    """``c`` first appeared after the round at 100 and its snapshot at 200 was never written:
    starting at 100 would lose ``c``'s records below it."""
    result = plan({"a": at(200, ("a", "b", "c"), "a"), "b": at(100, ("a", "b"), "b")})
    assert isinstance(result, Fallback)
    assert result.reason == "incomplete"
    assert "3 job(s)" in result.detail


def test_a_round_with_a_job_not_found_in_it_falls_back() -> None:
    """Equal counts are not enough: the job ids must be the round's."""
    result = plan({"a": at(100, ("a", "b"), "a"), "x": at(90, ("x",), "x")})
    assert isinstance(result, Fallback)
    assert result.reason == "incomplete"


def test_snapshots_past_the_committed_position_are_not_used() -> None:
    result = plan({"a": at(100, ("a",), "a")}, committed=99)
    assert isinstance(result, Fallback)
    assert result.reason == "ahead"
    assert isinstance(plan({"a": at(100, ("a",), "a")}, committed=100), Rebuild)


def test_a_refused_snapshot_or_one_of_another_partition_falls_back() -> None:
    good = at(100, ("a", "b"), "a")
    bad = flip(at(100, ("a", "b"), "b"), -1)
    result = plan({"a": good, "b": bad})
    assert isinstance(result, Fallback)
    assert (result.reason, result.job) == ("bad_signature", "b")
    moved = plan({"a": good, "b": at(100, ("a", "b"), "b")}, partition=3)
    assert isinstance(moved, Fallback)
    assert moved.reason == "partition"
