"""The daemon intake's MAC check on raw bytes (the fast path, which judges an agent's record
without decoding it) gives the verdicts and messages of the check after decoding, over
generated messages, keys (live, retired, another job's, nobody's) and MACed records as
senders, forgers and broken links make them (``tests/support/mac_mutations.py``)."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.mac_mutations import RawBytes, maced_records
from tests.support.schemas import STRATEGIES
from trainguard.agent.keys._keystore import DaemonKeys, KeyStore, key_id
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.core._inputs import Observed
from trainguard.daemon.core._intake import AuthRefusal, RawRecord, Refused, Taken, take
from trainguard.daemon.service._security import EventAuth
from trainguard.schemas import (
    EVENTS_TOPIC_TYPES,
    ClockTick,
    Event,
    HeartbeatBatch,
    JobRequest,
    canonical_bytes,
    encode,
)

JOB = "auth-job"


@dataclasses.dataclass(frozen=True, repr=False)
class Ring:
    """A key directory: ``JOB`` with a live and a retired event key, ``other-job`` with one,
    ``open-job`` with none; ``signers`` are ``(kid, key)`` pairs to MAC with (those three and
    a key nobody holds)."""

    keys: DaemonKeys
    signers: tuple[tuple[str, bytes], ...]

    def __repr__(self) -> str:  # Hypothesis prints a failing example's arguments: no keys
        return f"Ring({self.keys.store.path if self.keys.store else None})"


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Ring:
    admin = KeyAdmin(tmp_path_factory.mktemp("ring") / "keys")
    admin.init([JOB, "other-job"])
    store = KeyStore(admin.path)
    old = store.load_daemon_keys().current_event_key(JOB)
    assert old is not None
    admin.rotate("event", JOB)
    admin.retire(old[0])
    keys = store.load_daemon_keys()
    live, other = keys.current_event_key(JOB), keys.current_event_key("other-job")
    assert live is not None
    assert other is not None
    nobody = os.urandom(32)
    return Ring(keys, (live, live, old, other, (key_id(nobody), nobody)))


class _Spy:
    """``auth``, with (``raw``) or without the MAC check on raw bytes (without it, intake
    decodes every record whole), counting the records that reach :meth:`refuse`."""

    def __init__(self, auth: EventAuth, *, raw: bool) -> None:
        self.auth, self.raw, self.judged = auth, raw, 0

    def refuse(
        self, record: RawRecord, message: Event | JobRequest | HeartbeatBatch | ClockTick
    ) -> tuple[AuthRefusal, str] | None:
        self.judged += 1
        return self.auth.refuse(record, message)

    def mac_keys(self, record: RawRecord) -> Mapping[str, bytes] | None:
        return self.auth.mac_keys(record) if self.raw else None


def _outcome(taken: Taken | Refused) -> tuple[object, ...]:
    """What intake decided, messages by their encoding (a NaN loss equals a NaN loss)."""
    if isinstance(taken, Refused):
        return (taken.code, taken.auth, taken.reason)
    item = taken.input
    folded = (item.at_ns, item.offset, encode(item.event)) if isinstance(item, Observed) else item
    return (taken.job_id, folded, encode(taken.message), taken.input_id)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_mac_checked_on_raw_bytes_gives_the_verdicts_of_the_full_check(
    ring: Ring, data: st.DataObject
) -> None:
    """Live and rebuilding, with and without require_auth: intake takes and refuses the same
    records, with the same reasons and messages, as when it decodes every record before
    judging it; what an agent sends is taken on its raw bytes."""
    cls = data.draw(st.sampled_from(EVENTS_TOPIC_TYPES))
    job = data.draw(st.sampled_from((JOB, JOB, "other-job", "open-job")))
    message = dataclasses.replace(data.draw(STRATEGIES[cls]), job_id=job, auth=None)
    kid, key = data.draw(st.sampled_from(ring.signers))
    other = next(s for s in ring.signers if s[0] != kid)
    how, value = data.draw(maced_records(canonical_bytes(message), kid, key, other))
    record = RawBytes(value, key=data.draw(st.sampled_from((job, job, job, "other-job", None))))
    for rebuilding, require in itertools.product((False, True), repeat=2):
        one, two = (
            EventAuth(ring.keys, require=require, rebuilding=rebuilding, clock=lambda: 0.0)
            for _ in range(2)
        )
        raw = _Spy(one, raw=True)
        fast, full = take(record, raw), take(record, _Spy(two, raw=False))
        assert _outcome(fast) == _outcome(full)
        if how == "same/sent" and record.key == job == JOB and key == ring.signers[0][1]:
            assert isinstance(fast, Taken)
            assert raw.judged == 0  # taken on the raw bytes
    hypothesis.event(f"{how}: {'taken' if isinstance(fast, Taken) else fast.code}")
