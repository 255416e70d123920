"""Fuzz test of the daemon's input path: hostile ``events`` records never hurt it.

Each example is a batch of :data:`INPUTS_PER_EXAMPLE` records, valid and bad mixed, appended to
a fresh embedded bus and consumed by a real :class:`DaemonService` that requires authentication
(a key directory with an event key per job). Bad records are bad by construction: random bytes,
truncations, byte-level mutations of valid messages (bad unless they still parse to the very
same JSON object), wrong types, missing fields, huge and negative numbers, deep nesting,
oversized and invalid UTF-8 strings, wrong schema tags, duplicate keys, non-objects, tombstones,
mismatched record keys, sizes around the codec's 64 KiB limit, and every way a MAC can be
wrong. Most of them carry a *valid* MAC over their bad content, so the schema checks are tested
behind authentication, as a compromised worker would send them.

For every example: the service stops cleanly (no exception escapes, nothing logged at error
level); every bad record has a ``dead-letter`` entry with a reason and the digest of its
original bytes; and the job states equal a fold of the valid records alone.

Under ``CI=true`` the ``fuzz-ci`` profile runs 200 examples, 10,000 inputs; locally ``fuzz``
runs a few.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from tests.support.machine_scenarios import Sim
from trainguard.agent.bus import (
    DEFAULT_TOPICS,
    BusConfig,
    Record,
    TopicPartition,
    TopicSpec,
    open_bus,
)
from trainguard.agent.keys._keystore import DaemonKeys, KeyStore
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.core._intake import Taken, take
from trainguard.daemon.core._machine import decide, unacted_command
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import JobState, new_job
from trainguard.daemon.service._daemon import DaemonService
from trainguard.daemon.service._settings import DaemonConfig, SecurityConfig
from trainguard.schemas import ClockTick, Event, add_mac, encode
from trainguard.schemas._auth import received_canonical_bytes
from trainguard.schemas._codec import DEFAULT_MAX_BYTES

INPUTS_PER_EXAMPLE = 50
settings.register_profile(
    "fuzz-ci",
    max_examples=200,  # x INPUTS_PER_EXAMPLE = 10,000 inputs
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # No shrinking: an example takes ~0.3 s, shrinking one takes minutes, and a failure
    # names the family of the record at fault anyway.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.register_profile("fuzz", settings.get_profile("fuzz-ci"), max_examples=8)
FUZZ = settings.get_profile("fuzz-ci" if os.environ.get("CI") == "true" else "fuzz")

JOBS = ("fz-a", "fz-b")
SENTINEL = "fz-sentinel"
"""A job whose one valid record is appended last: once it is folded, every record was."""
NO_KEY_JOB = "fz-nokey"
"""A job without an event key: its records are refused (authentication is required)."""
MACHINE = MachineConfig(daemon_id="fuzz-daemon")
# One partition: the records are processed in the order they were appended.
TOPICS = tuple(TopicSpec(t.name, partitions=1, compacted=t.compacted) for t in DEFAULT_TOPICS)
EVENTS_TP = TopicPartition("events", 0)
INT_FIELDS = ("generation", "ts", "seq", "pid")
# Bounds of the schema's integers (common.v1.json): just outside them, and far outside.
OUT_OF_RANGE = (b"-1", b"9223372036854775808", b"18446744073709551616", b"1" + b"0" * 400)


class Item:
    """One record to append: its key, its value (``None``: a tombstone), whether it is valid
    (to be folded) or bad (to be dead-lettered), and the family that made it.

    Not a dataclass: Hypothesis prints a failing example's dataclasses field by field, and a
    batch holds values of hundreds of kilobytes; this ``repr`` cuts them short.
    """

    __slots__ = ("family", "key", "valid", "value")

    def __init__(self, key: str, value: bytes | None, valid: bool, family: str) -> None:
        self.key, self.value, self.valid, self.family = key, value, valid, family

    def __repr__(self) -> str:
        value = self.value
        if value is not None and len(value) > 160:
            value = value[:120] + b"..." + value[-20:]
        size = "" if self.value is None else f", {len(self.value)} bytes"
        return f"Item({self.family}, valid={self.valid}, key={self.key!r}{size}, {value!r})"


class Keys:
    """The daemon's keys (in ``path``) and each keyed job's current event key ``(kid, key)``.

    Not a dataclass: Hypothesis prints a failing example's arguments field by field, keys
    included, and these are secrets (if only a test's).
    """

    def __init__(self, daemon: DaemonKeys, path: Path, event: dict[str, tuple[str, bytes]]):
        self.daemon, self.path, self.event = daemon, path, event

    def __repr__(self) -> str:
        return f"Keys({self.path})"


@pytest.fixture(scope="module")
def keys() -> Iterator[Keys]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "keys"
        KeyAdmin(path).init(jobs=(*JOBS, SENTINEL))
        daemon = KeyStore(path).load_daemon_keys()
        event = {}
        for job in (*JOBS, SENTINEL):
            current = daemon.current_event_key(job)
            assert current is not None
            event[job] = current
        yield Keys(daemon, path, event)


# -- building records ----------------------------------------------------------------------


def with_mac(text: bytes, kid: str, key: bytes) -> bytes:
    """``text`` (a JSON object without ``auth``) with an ``auth`` member holding its valid MAC,
    whatever the object holds; ``text`` unchanged when it does not parse as an object (no MAC
    can be computed over it)."""
    try:
        canonical, _ = received_canonical_bytes(text)
    except (ValueError, TypeError):  # TypeError: nested deeper than orjson serialises
        return text
    tag = base64.b64encode(hmac.new(key, canonical, hashlib.sha256).digest())
    return b'{"auth":{"kid":"' + kid.encode() + b'","mac":"' + tag + b'"},' + text[1:]


def splice(obj: dict[str, Any], field: str, raw: bytes) -> bytes:
    """``obj`` as JSON with ``field``'s value replaced by the raw JSON text ``raw``."""
    marker = "\x00splice\x00"
    text = orjson.dumps({**obj, field: marker})
    return text.replace(orjson.dumps(marker), raw)


def parses_to(data: bytes, wire: dict[str, Any]) -> bool:
    """Whether ``data`` parses to exactly ``wire``, types included (``1.0`` is not ``1``,
    ``true`` not ``1``): then it is the same message, and its MAC still verifies."""
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    same = orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS)
    return same == orjson.dumps(wire, option=orjson.OPT_SORT_KEYS)


@st.composite
def events(draw: st.DrawFn, sims: dict[str, Sim]) -> tuple[str, Event | ClockTick]:
    """A valid event of one of the keyed jobs, as its agents or supervisors send them."""
    job = draw(st.sampled_from(JOBS))
    sim = sims[job]
    rank = draw(st.integers(0, sim.world_size - 1))
    step = draw(st.integers(0, 40))
    what = draw(
        st.sampled_from(("beat", "beat", "beat", "ckpt", "cursor", "start", "kill", "done", "tick"))
    )
    if what == "tick":
        tick = ClockTick(job_id=job, generation=sim.generation, ts=1, seq=step, daemon_id="d")
        return job, tick
    observed = {
        "beat": lambda: sim.heartbeat(rank, step, 0),
        "ckpt": lambda: sim.checkpoint(rank, step, 0),
        "cursor": lambda: sim.cursor(rank, step, 0),
        "start": lambda: sim.lifecycle(rank, "started", 0, world_size=sim.world_size),
        "kill": lambda: sim.kill(rank, 0),
        "done": lambda: sim.lifecycle(rank, "finished", 0, step=step),
    }[what]()
    assert isinstance(observed.event, Event)
    return job, observed.event


@st.composite
def items(draw: st.DrawFn, keys: Keys, sims: dict[str, Sim]) -> Item:
    """One valid or bad record (module docstring)."""
    job, event = draw(events(sims))
    kid, key = keys.event[job]
    good = encode(add_mac(event, kid, key))
    wire: dict[str, Any] = orjson.loads(good)
    bare = orjson.loads(encode(event))  # without auth
    family = draw(
        st.sampled_from(
            (
                "valid",
                "valid",
                "valid",
                "valid",
                "padded",
                "random_bytes",
                "truncated",
                "mutated",
                "wrong_type",
                "missing",
                "huge_number",
                "deep_nesting",
                "deep_unknown_member",
                "long_string",
                "bad_utf8",
                "wrong_schema",
                "duplicate_key",
                "non_object",
                "tombstone",
                "key_mismatch",
                "oversized",
                "no_mac",
                "bad_mac",
                "other_key",
                "unknown_kid",
                "unknown_job",
                "malformed_auth",
            )
        )
    )
    signed: Callable[[bytes], bytes] = lambda text: with_mac(text, kid, key)  # noqa: E731

    def bad(value: bytes | None, record_key: str = job) -> Item:
        return Item(record_key, value, False, family)

    if family == "valid":
        return Item(job, good, True, family)
    if family == "padded":
        # Whitespace changes no JSON value, so the MAC still verifies; up to exactly the limit.
        size = draw(st.sampled_from((len(good) + 1, len(good) + 17, DEFAULT_MAX_BYTES)))
        return Item(job, good + b" " * (size - len(good)), True, family)
    if family == "oversized":
        size = draw(st.integers(DEFAULT_MAX_BYTES + 1, 4 * DEFAULT_MAX_BYTES))
        return bad(good + b" " * (size - len(good)))
    if family == "random_bytes":
        return bad(draw(st.binary(max_size=400)))
    if family == "truncated":
        return bad(good[: draw(st.integers(0, len(good) - 1))])
    if family == "mutated":
        data = bytearray(good)
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(data) - 1))
            how = draw(st.sampled_from(("flip", "insert", "delete")))
            if how == "flip":
                data[at] ^= draw(st.integers(1, 255))
            elif how == "insert":
                data.insert(at, draw(st.integers(0, 255)))
            elif len(data) > 1:
                del data[at]
        # A mutation that leaves the same JSON object (inserted whitespace) is the same
        # authentic message: valid.
        return Item(job, bytes(data), parses_to(bytes(data), wire), family)
    if family == "wrong_type":
        field = draw(st.sampled_from((*INT_FIELDS, "host", "job_id")))
        wrong = draw(st.sampled_from(("1", True, False, None, 1.5, [], {}, [1], {"a": 1})))
        if field in ("host", "job_id"):
            wrong = draw(st.sampled_from((1, True, None, [], {}, 1.5)))
        return bad(signed(orjson.dumps({**bare, field: wrong})))
    if family == "missing":
        required = ("schema", "job_id", *INT_FIELDS, "host")
        field = draw(st.sampled_from([f for f in required if f in bare]))  # ticks have no host
        return bad(signed(orjson.dumps({k: v for k, v in bare.items() if k != field})))
    if family == "huge_number":
        field = draw(st.sampled_from(INT_FIELDS))
        return bad(signed(splice(bare, field, draw(st.sampled_from((*OUT_OF_RANGE, b"1e400"))))))
    if family == "deep_nesting":
        depth = draw(st.sampled_from((2, 64, 1023, 1025, 5000, 200_000)))
        field = draw(st.sampled_from(("host", "seq", "nested")))
        return bad(signed(splice(bare, field, b"[" * depth + b"]" * depth)))
    if family == "deep_unknown_member":
        # A newer minor version's unknown member is dropped by the tolerant reader, so its
        # nesting reaches whatever looks at the raw bytes after decoding (the MAC check).
        # Valid when its sender could MAC it (orjson serialises 255 levels), else refused.
        depth = draw(st.sampled_from((100, 300, 1000)))
        newer = {**bare, "schema": bare["schema"].split(".")[0] + ".99"}
        text = splice(newer, "x", b"[" * depth + b"]" * depth)
        value = signed(text)
        return Item(job, value, value != text, family)
    if family == "long_string":
        length = draw(st.sampled_from((256, 4096, 60_000)))
        return bad(signed(orjson.dumps({**bare, "host": "h" * length})))
    if family == "bad_utf8":
        return bad(signed(splice(bare, "host", b'"h\xff\xfe"')))
    if family == "wrong_schema":
        tag = draw(
            st.sampled_from(
                ("heartbeat/2.0", "restore/1.1", "manifest/1.0", "", "heartbeat", "x/1.0", 7, None)
            )
        )
        return bad(signed(orjson.dumps({**bare, "schema": tag})))
    if family == "duplicate_key":
        # The last of duplicate keys wins; here it is of the wrong type.
        return bad(signed(orjson.dumps(bare)[:-1] + b',"seq":"x"}'))
    if family == "non_object":
        return bad(draw(st.sampled_from((b"[]", b"1", b'"s"', b"null", b"true", b"", b" "))))
    if family == "tombstone":
        return bad(None)
    if family == "key_mismatch":
        other = draw(st.sampled_from((*(j for j in JOBS if j != job), "other", "")))
        return bad(good, other)
    if family == "no_mac":
        return bad(encode(event))
    if family == "bad_mac":
        mac = bytearray(wire["auth"]["mac"].encode())
        at = draw(st.integers(0, 41))  # the last two characters may be base64 padding
        mac[at] = ord("A") if mac[at] != ord("A") else ord("B")
        return bad(orjson.dumps({**wire, "auth": {**wire["auth"], "mac": mac.decode()}}))
    if family == "other_key":
        other_kid, other_key = keys.event[next(j for j in JOBS if j != job)]
        return bad(encode(add_mac(event, other_kid, other_key)))
    if family == "unknown_kid":
        return bad(orjson.dumps({**wire, "auth": {**wire["auth"], "kid": "0123456789abcdef"}}))
    if family == "unknown_job":
        return bad(encode(add_mac(replace(event, job_id=NO_KEY_JOB), kid, key)), NO_KEY_JOB)
    assert family == "malformed_auth"
    malformed: list[object] = ["x", None, 1, [], {"kid": kid}, {"kid": 1, "mac": "x"}]
    auth = draw(st.sampled_from(malformed))
    return bad(orjson.dumps({**wire, "auth": auth}))


@st.composite
def batches(draw: st.DrawFn, keys: Keys) -> list[Item]:
    """:data:`INPUTS_PER_EXAMPLE` records of jobs with 1-3 ranks each."""
    sims = {job: Sim(world_size=draw(st.integers(1, 3)), job_id=job) for job in JOBS}
    return [draw(items(keys, sims)) for _ in range(INPUTS_PER_EXAMPLE)]


def sentinel(keys: Keys) -> Item:
    """The valid record appended after every batch."""
    kid, key = keys.event[SENTINEL]
    event = Sim(world_size=1, job_id=SENTINEL).lifecycle(0, "started", 0, world_size=1).event
    assert isinstance(event, Event)
    return Item(SENTINEL, encode(add_mac(event, kid, key)), True, "sentinel")


# -- running the daemon ----------------------------------------------------------------------


def bus_at(folder: Path) -> BusConfig:
    """The embedded bus of one example, polled every millisecond when idle (the test waits
    on it; the default 20 ms would be most of an example's time)."""
    return BusConfig(
        url=f"sqlite://{folder / 'bus.db'}", prefix="fz.", topics=TOPICS, idle_poll_s=0.001
    )


async def _read(config: BusConfig, topic: str) -> list[Record]:
    """Every record of ``topic`` (one partition), in offset order."""
    async with open_bus(config) as bus, asyncio.timeout(30):
        end = (await bus.end_offsets(topic))[TopicPartition(topic, 0)]
        records: list[Record] = []
        if end:
            async with await bus.assign({TopicPartition(topic, 0): 0}) as consumer:
                while not records or records[-1].offset < end - 1:
                    records += await consumer.getmany(timeout_s=1.0)
        return records


async def _run_daemon(folder: Path, keys: Keys, batch: list[Item]) -> tuple[DaemonService, Any]:
    """Append ``batch`` (the sentinel last), run the service until it folded the sentinel."""
    bus_config = bus_at(folder)
    async with open_bus(bus_config) as bus:
        sent = [await bus.send("events", item.key, item.value) for item in batch]
        await asyncio.gather(*sent)
    config = DaemonConfig(
        bus=bus_config,
        machine=MACHINE,
        security=SecurityConfig(keys_dir=keys.path, require_auth=True),
        metrics_port=-1,
        poll_s=0.002,
        snapshot_interval_s=0,
    )
    # The clock stays at 0: no deadline is ever due, so the only ticks the daemon appends are
    # those naming the commands it published; it stops once it folded them.
    service = DaemonService(config, clock=lambda: 0, keys=keys.daemon)
    stop = asyncio.Event()

    def done() -> bool:
        jobs = service.jobs.values()
        return SENTINEL in service.jobs and all(unacted_command(s) is None for s in jobs)

    with capture_logs() as logs:
        task = asyncio.create_task(service.run(stop))
        async with asyncio.timeout(60):
            while not done() and not task.done():  # noqa: ASYNC110 (no event to wait on)
                await asyncio.sleep(0.005)
        stop.set()
        await task  # re-raises anything that escaped the service
    return service, logs


def _reference(records: list[Record], valid: set[int]) -> dict[str, JobState]:
    """The job states of a fold of the valid records alone (the daemon's ticks included), in
    bus order, at their bus times."""
    states: dict[str, JobState] = {}
    for record in records:
        if record.offset not in valid:
            continue
        taken = take(record)
        assert isinstance(taken, Taken), f"a valid record was refused: {taken}"
        state = states.get(taken.job_id) or new_job(taken.job_id)
        states[taken.job_id], _ = decide(state, taken.input, MACHINE)
    return states


@FUZZ
@given(data=st.data())
def test_bad_input_is_dead_lettered_and_changes_no_job(keys: Keys, data: st.DataObject) -> None:
    batch = [*data.draw(batches(keys)), sentinel(keys)]
    with tempfile.TemporaryDirectory() as folder:
        service, logs = asyncio.run(_run_daemon(Path(folder), keys, batch))
        config = bus_at(Path(folder))
        events = asyncio.run(_read(config, "events"))
        parked = asyncio.run(_read(config, "dead-letter"))

    assert [r.value for r in events[: len(batch)]] == [item.value for item in batch]
    ticks = events[len(batch) :]
    assert all(
        isinstance(taken := take(r), Taken) and isinstance(taken.message, ClockTick) for r in ticks
    )
    errors = [entry for entry in logs if entry["log_level"] in ("error", "critical")]
    assert errors == []

    entries = {}
    for record in parked:
        assert record.value is not None
        entry = orjson.loads(record.value)
        entries[(entry["partition"], entry["offset"])] = entry
    for record, item in zip(events[: len(batch)], batch, strict=True):
        if item.valid:
            continue
        entry = entries.get((record.partition, record.offset))
        assert entry is not None, f"{item.family} record at {record.offset} not dead-lettered"
        assert entry["reason"]
        assert entry["value_sha256"] == hashlib.sha256(item.value or b"").hexdigest()

    valid = {r.offset for r, item in zip(events[: len(batch)], batch, strict=True) if item.valid}
    valid |= {r.offset for r in ticks}
    assert service.jobs == _reference(events, valid)
