"""Authentication on the wire (docs/wire-contract.md, Authentication): MACs on events and ticks,
Ed25519 signatures on commands and manifests, over canonical bytes that another implementation
can reproduce from the documented rules and test vectors."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import math
import re
import secrets
from decimal import Decimal
from typing import Any

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.mac_mutations import auth_first, auth_member, mac_of, maced_records
from tests.support.schemas import (
    REPO,
    STRATEGIES,
    codec_validator,
    example,
    reference_validator,
    same_message,
)
from trainguard.schemas import (
    DEFAULT_MAX_BYTES,
    Abort,
    Checkpoint,
    ClockTick,
    DataCursorEvent,
    Heartbeat,
    Lifecycle,
    Mac,
    Manifest,
    Message,
    MessageTooLarge,
    Restore,
    Resume,
    SchemaError,
    Signature,
    Unauthenticated,
    add_mac,
    canonical_bytes,
    decode,
    decode_maced,
    encode,
    sign,
    split_mac,
    verify_mac,
    verify_raw_mac,
    verify_signature,
)
from trainguard.schemas._auth import received_canonical_bytes

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MACED = (Heartbeat, Checkpoint, DataCursorEvent, Lifecycle, ClockTick)
SIGNED = (Restore, Resume, Abort, Manifest)

EVENT_KEY = bytes(range(32))
EVENT_KID = hashlib.sha256(EVENT_KEY).digest()[:8].hex()
SIGNING = Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64)))
SIGNING_KID = "24f6ed6acbfe1009"


OTHER_KEY = bytes(range(64, 96))


def kid_of(key: bytes) -> str:
    return hashlib.sha256(key).digest()[:8].hex()


def doc_text() -> str:
    return (REPO / "docs" / "wire-contract.md").read_text(encoding="utf-8")


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MACED, ids=lambda c: c.__name__)
@SETTINGS
@given(data=st.data())
def test_a_maced_message_verifies_and_any_change_breaks_it(cls: Any, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[cls])
    maced = add_mac(msg, EVENT_KID, EVENT_KEY)
    wire = encode(maced)
    assert verify_mac(wire, {EVENT_KID: EVENT_KEY}) == EVENT_KID
    assert same_message(decode(wire), maced)
    changed = dataclasses.replace(maced, seq=(msg.seq + 1) % 2**63)
    with pytest.raises(Unauthenticated) as info:
        verify_mac(encode(changed), {EVENT_KID: EVENT_KEY})
    assert info.value.code == "bad_mac"


@pytest.mark.parametrize("cls", SIGNED, ids=lambda c: c.__name__)
@SETTINGS
@given(data=st.data())
def test_a_signed_message_verifies_and_any_change_breaks_it(cls: Any, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[cls])
    signed = sign(msg, SIGNING_KID, SIGNING)
    wire = encode(signed)
    assert verify_signature(wire, {SIGNING_KID: SIGNING.public_key()}) == SIGNING_KID
    assert decode(wire) == signed
    changed = dataclasses.replace(signed, generation=(msg.generation + 1) % 2**63)
    with pytest.raises(Unauthenticated) as info:
        verify_signature(encode(changed), {SIGNING_KID: SIGNING.public_key()})
    assert info.value.code == "bad_signature"


def test_an_unauthenticated_message_encodes_exactly_as_before_auth_existed() -> None:
    hb = decode(orjson.dumps(example("heartbeat")), expect=Heartbeat)
    wire = orjson.loads(encode(hb))
    assert "auth" not in wire
    assert encode(hb) == canonical_bytes(hb)
    assert canonical_bytes(add_mac(hb, EVENT_KID, EVENT_KEY)) == encode(hb)


@pytest.mark.parametrize("tag", ["heartbeat/1.0", "heartbeat/1.1"])
def test_older_minor_versions_without_auth_still_decode(tag: str) -> None:
    wire = example("heartbeat") | {"schema": tag}
    wire.pop("auth", None)
    assert decode(orjson.dumps(wire), expect=Heartbeat).auth is None


# -- failures -----------------------------------------------------------------------------------


def test_each_failure_has_its_code_and_never_shows_a_key() -> None:
    hb = decode(orjson.dumps(example("heartbeat")), expect=Heartbeat)
    keys = {EVENT_KID: EVENT_KEY}
    cases = {
        "missing": encode(hb),
        "unknown_kid": encode(add_mac(hb, "0" * 16, EVENT_KEY)),
        "bad_mac": encode(add_mac(hb, EVENT_KID, secrets.token_bytes(32))),
    }
    for code, wire in cases.items():
        with pytest.raises(Unauthenticated) as info:
            verify_mac(wire, keys)
        error = info.value
        assert (error.code, error.field) == (code, "auth")
        assert isinstance(error, SchemaError)
        for secret in (EVENT_KEY.hex(), base64.b64encode(EVENT_KEY).decode()):
            assert secret not in str(error)


def test_a_signature_is_not_a_mac_and_the_wrong_public_key_fails() -> None:
    resume = decode(orjson.dumps(example("resume")), expect=Resume)
    signed = encode(sign(resume, SIGNING_KID, SIGNING))
    with pytest.raises(Unauthenticated) as info:
        verify_mac(signed, {SIGNING_KID: EVENT_KEY})
    assert info.value.code == "missing"
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(Unauthenticated) as info:
        verify_signature(signed, {SIGNING_KID: other})
    assert info.value.code == "bad_signature"
    with pytest.raises(Unauthenticated) as info:
        verify_signature(encode(resume), {SIGNING_KID: SIGNING.public_key()})
    assert info.value.code == "missing"


def test_a_mac_cannot_be_moved_to_another_message_type_or_version() -> None:
    maced = orjson.loads(encode(add_mac(Heartbeat(**_hb_fields()), EVENT_KID, EVENT_KEY)))
    newer = maced | {"schema": "heartbeat/1.9"}  # decodes (tolerant reader), MAC fails
    decode(orjson.dumps(newer))
    with pytest.raises(Unauthenticated):
        verify_mac(orjson.dumps(newer), {EVENT_KID: EVENT_KEY})
    tick = ClockTick(job_id="j", generation=0, ts=5, seq=1, daemon_id="d")
    tick_wire = orjson.loads(encode(tick)) | {"auth": maced["auth"]}
    with pytest.raises(Unauthenticated):
        verify_mac(orjson.dumps(tick_wire), {EVENT_KID: EVENT_KEY})


def test_what_a_newer_sender_adds_is_covered_though_this_reader_drops_it() -> None:
    """A newer minor's sender MACs properties this build does not know; the MAC verifies over
    what was received, and tampering with the unknown property is caught."""
    wire = example("heartbeat") | {"schema": "heartbeat/1.9", "added_in_1_9": {"x": [1, 2.5]}}
    canonical = orjson.dumps(wire, option=orjson.OPT_SORT_KEYS)
    mac = base64.b64encode(hmac.new(EVENT_KEY, canonical, hashlib.sha256).digest()).decode()
    sent = wire | {"auth": {"kid": EVENT_KID, "mac": mac}}
    assert verify_mac(orjson.dumps(sent), {EVENT_KID: EVENT_KEY}) == EVENT_KID
    assert decode(orjson.dumps(sent), expect=Heartbeat).auth == Mac(kid=EVENT_KID, mac=mac)
    tampered = sent | {"added_in_1_9": {"x": [1, 3.5]}}
    with pytest.raises(Unauthenticated):
        verify_mac(orjson.dumps(tampered), {EVENT_KID: EVENT_KEY})


def test_a_duplicate_key_counts_once_for_the_mac_as_for_decoding() -> None:
    hb = Heartbeat(**_hb_fields())
    maced = encode(add_mac(hb, EVENT_KID, EVENT_KEY))
    smuggled = maced[:-1] + b',"step":999}'  # the last duplicate wins in both
    assert decode(smuggled, expect=Heartbeat).step == 999
    with pytest.raises(Unauthenticated):
        verify_mac(smuggled, {EVENT_KID: EVENT_KEY})


@pytest.mark.parametrize(
    "auth",
    [
        {"kid": "ABCDEF0123456789", "mac": "A" * 43 + "="},
        {"kid": "0" * 15, "mac": "A" * 43 + "="},
        {"kid": "0" * 16, "mac": "A" * 44},
        {"kid": "0" * 16, "mac": "A" * 42 + "=="},
        {"kid": "0" * 16},
        {"kid": "0" * 16, "mac": "A" * 43 + "=", "extra": 1},
        {"kid": "0" * 16, "sig": "A" * 86 + "=="},
    ],
)
def test_both_validators_reject_a_malformed_mac(auth: dict[str, Any]) -> None:
    wire = example("heartbeat") | {"auth": auth}
    assert not reference_validator("heartbeat.v1").is_valid(wire)
    with pytest.raises(SchemaError) as info:
        decode(orjson.dumps(wire))
    assert info.value.field is not None
    assert info.value.field.startswith("auth")


def test_both_validators_accept_auth_objects_and_null() -> None:
    signed = orjson.loads(encode(sign(Resume(**_resume_fields()), SIGNING_KID, SIGNING)))
    for wire in (signed, signed | {"auth": None}):
        assert reference_validator("resume.v1").is_valid(wire)
        codec_validator("resume.v1")(wire)
    assert decode(orjson.dumps(signed), expect=Resume).auth == Signature(**signed["auth"])


# -- the MAC on raw bytes ----------------------------------------------------------------------


@pytest.mark.parametrize("cls", MACED, ids=lambda c: c.__name__)
@settings(SETTINGS, max_examples=150)
@given(data=st.data())
def test_the_mac_on_raw_bytes_agrees_with_verify_mac_and_decode(
    cls: Any, data: st.DataObject
) -> None:
    """Whatever split_mac cuts is what verify_mac works on (same canonical bytes, kid, MAC),
    verify_raw_mac gives verify_mac's verdict, and decode_maced the message decode gives for
    the whole (or fails alike); what encode writes is cut."""
    msg = data.draw(STRATEGIES[cls])
    canonical = canonical_bytes(msg)
    how, value = data.draw(
        maced_records(canonical, EVENT_KID, EVENT_KEY, (kid_of(OTHER_KEY), OTHER_KEY))
    )
    raw = split_mac(value)
    event(f"{how}: {'cut' if raw else 'not cut'}")
    if how == "same/sent":
        assert value == encode(add_mac(msg, EVENT_KID, EVENT_KEY))
        assert raw is not None
    if raw is None:
        return
    assert received_canonical_bytes(value) == (raw.canonical, {"kid": raw.kid, "mac": raw.mac})
    for keys in ({EVENT_KID: EVENT_KEY}, {kid_of(OTHER_KEY): OTHER_KEY}, {}):
        try:
            verdict = verify_mac(value, keys) == raw.kid
        except Unauthenticated:
            verdict = False
        assert verify_raw_mac(raw, keys) == verdict
    try:
        whole: Message | None = decode(value)
    except SchemaError:
        whole = None
    try:
        part: Message | None = decode_maced(raw)
    except SchemaError:
        part = None
    assert (whole is None) == (part is None)
    if whole is not None and part is not None:
        assert same_message(whole, part)


def test_only_canonical_bytes_with_the_mac_first_are_cut() -> None:
    """Bytes a key holder MACed as they are, but which are not canonical, are not cut, though
    their MAC verifies on them: verify_mac refuses them, or takes them by another MAC."""
    canonical = canonical_bytes(Heartbeat(**_hb_fields()))
    sent = auth_member(EVENT_KID, mac_of(canonical, EVENT_KEY))
    assert split_mac(auth_first(canonical, sent)) is not None
    remaced = {
        "space": canonical.replace(b",", b", ", 1),
        "unsorted": orjson.dumps(dict(reversed(orjson.loads(canonical).items()))),
        "duplicate": canonical[:-1] + b',"step":999}',
        "escape": canonical.replace(b'"host"', b'"h\\u006fst"'),
        "trailing": canonical + b" ",
        "empty": b"{}",
    }
    for name, body in remaced.items():
        value = auth_first(body, auth_member(EVENT_KID, mac_of(body, EVENT_KEY)))
        assert split_mac(value) is None, name
        with pytest.raises((Unauthenticated, SchemaError)):
            verify_mac(value, {EVENT_KID: EVENT_KEY})
    # The second auth member wins: verify_mac takes this by its (valid) MAC of the canonical
    # bytes, whatever the first says.
    body = auth_first(canonical, sent)
    value = auth_first(body, auth_member(EVENT_KID, mac_of(body, EVENT_KEY)))
    assert split_mac(value) is None
    assert verify_mac(value, {EVENT_KID: EVENT_KEY}) == EVENT_KID
    newer = orjson.loads(canonical) | {"schema": "heartbeat/1.9", "x": "x" * DEFAULT_MAX_BYTES}
    body = orjson.dumps(newer, option=orjson.OPT_SORT_KEYS)
    too_large = auth_first(body, auth_member(EVENT_KID, mac_of(body, EVENT_KEY)))
    assert split_mac(too_large) is None
    with pytest.raises(MessageTooLarge):
        decode(too_large)


# -- the documentation --------------------------------------------------------------------------


def _documented_float(x: float) -> str:
    """Rule 5 of the canonical bytes, as docs/wire-contract.md words it."""
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    sign, digits, exponent = Decimal(repr(x)).normalize().as_tuple()
    assert isinstance(exponent, int)
    text = "".join(map(str, digits))
    k = len(text) + exponent
    if -5 < k <= 16:
        if exponent >= 0:
            body = text + "0" * exponent + ".0"
        elif k > 0:
            body = text[:k] + "." + text[k:]
        else:
            body = "0." + "0" * -k + text
    else:
        e = k - 1
        body = (
            text[0]
            + ("." + text[1:] if len(text) > 1 else "")
            + f"e{'+' if e >= 0 else '-'}{abs(e)}"
        )
    return ("-" if sign else "") + body


@settings(max_examples=3000, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_the_documented_float_rule_is_what_orjson_writes(x: float) -> None:
    assert _documented_float(x) == orjson.dumps(x).decode()


def test_the_documented_string_and_key_rules_are_what_orjson_writes() -> None:
    text = "".join(chr(i) for i in range(0x20)) + '"\\/\x7f\u2028é😀'
    expected = (
        '"\\u0000\\u0001\\u0002\\u0003\\u0004\\u0005\\u0006\\u0007\\b\\t\\n\\u000b\\f\\r'
        "\\u000e\\u000f\\u0010\\u0011\\u0012\\u0013\\u0014\\u0015\\u0016\\u0017\\u0018\\u0019"
        '\\u001a\\u001b\\u001c\\u001d\\u001e\\u001f\\"\\\\/\x7f\u2028é😀"'
    )
    assert orjson.dumps(text).decode() == expected
    keys = ["😀", "\uffff", "é", "z", "a", "Z", "auth"]
    written = orjson.dumps(dict.fromkeys(keys, 1), option=orjson.OPT_SORT_KEYS).decode()
    assert re.findall(r'"(.*?)":', written) == sorted(keys)  # code point order


def test_the_documented_test_vectors_verify() -> None:
    doc = doc_text()
    assert EVENT_KEY.hex() in doc
    assert EVENT_KID in doc
    assert bytes(range(32, 64)).hex() in doc
    assert SIGNING_KID in doc
    blocks = [orjson.loads(b) for b in re.findall(r"```json\n(.*?)```", doc, re.DOTALL)]
    maced = next(b for b in blocks if b.get("auth", {}).get("mac"))
    signed = next(b for b in blocks if b.get("auth", {}).get("sig"))
    assert verify_mac(orjson.dumps(maced), {EVENT_KID: EVENT_KEY}) == EVENT_KID
    public = {SIGNING_KID: SIGNING.public_key()}
    assert verify_signature(orjson.dumps(signed), public) == SIGNING_KID
    documented = re.search(r"```text\n(\{.*?\})\n```", doc)
    assert documented is not None
    hb = decode(orjson.dumps(maced), expect=Heartbeat)
    assert canonical_bytes(hb) == documented[1].encode()
    # Deterministic: signing again gives the documented bytes.
    resume = decode(orjson.dumps(signed), expect=Resume)
    assert sign(dataclasses.replace(resume, auth=None), SIGNING_KID, SIGNING) == resume


def _hb_fields() -> dict[str, Any]:
    return {
        "job_id": "j",
        "generation": 0,
        "ts": 1,
        "seq": 2,
        "rank": 0,
        "host": "h",
        "pid": 3,
        "world_size": 1,
        "step": 4,
        "phase": "train",
        "step_time_s": 0.25,
    }


def _resume_fields() -> dict[str, Any]:
    return {"job_id": "j", "generation": 1, "ts": 2, "seq": 3, "daemon_id": "d", "step": 4}


def test_a_message_too_deep_for_canonical_bytes_never_verifies() -> None:
    """A newer minor's unknown property may nest up to orjson's parse limit (1024 levels);
    decoding drops it, but no canonical form exists beyond orjson's 254 levels of writing."""
    deep: Any = 1
    for _ in range(600):
        deep = [deep]
    hb = add_mac(Heartbeat(**_hb_fields()), EVENT_KID, EVENT_KEY)
    wire = orjson.loads(encode(hb)) | {"schema": "heartbeat/1.9", "future": deep}
    data = _dumps_deep(wire)
    assert decode(data, expect=Heartbeat).auth == hb.auth
    with pytest.raises(Unauthenticated) as info:
        verify_mac(data, {EVENT_KID: EVENT_KEY})
    assert info.value.code == "bad_mac"
    with pytest.raises(Unauthenticated) as info:
        verify_signature(data, {SIGNING_KID: SIGNING.public_key()})
    assert info.value.code == "bad_signature"


def _dumps_deep(wire: dict[str, Any]) -> bytes:
    """``wire`` as JSON, also nested deeper than orjson writes (600-level lists only)."""
    future = wire.pop("future")
    depth = 0
    while isinstance(future, list):
        future, depth = future[0], depth + 1
    head = orjson.dumps(wire)[:-1]
    return head + b',"future":' + b"[" * depth + b"1" + b"]" * depth + b"}"
