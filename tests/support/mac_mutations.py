"""MACed records as ``encode`` writes them and as senders, forgers and broken links change them:
the input of the tests that hold the MAC check on raw bytes (``split_mac``, ``verify_raw_mac``,
the daemon intake's fast path) to the check after decoding (``verify_mac``).

A record is a body (the canonical bytes, or a changed copy) with an ``auth`` member put in front
of it, or elsewhere: the MAC of the canonical bytes (what a sender sends), a MAC of the body as
it is (a key holder MACing bytes that are not canonical), one under another key, or a damaged
``auth``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac

import orjson
from hypothesis import strategies as st


@dataclasses.dataclass(frozen=True)
class RawBytes:
    """A bus record as intake reads it (``RawRecord``): ``value`` the record's bytes."""

    value: bytes
    key: str | None = "auth-job"
    offset: int = 0
    timestamp_ms: int = 0


B64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def mac_of(body: bytes, key: bytes) -> str:
    """Base64 of the HMAC-SHA256 of ``body`` under ``key``."""
    return base64.b64encode(hmac.new(key, body, hashlib.sha256).digest()).decode()


def auth_member(kid: str, mac: str, separator: bytes = b"") -> bytes:
    """``"auth":{"kid":...,"mac":...}`` as orjson writes it (``separator`` after each colon)."""
    return b'"auth":%b{"kid":%b"%b","mac":%b"%b"}' % (
        separator,
        separator,
        kid.encode(),
        separator,
        mac.encode(),
    )


def auth_first(body: bytes, member: bytes) -> bytes:
    """``body`` (a JSON object's text) with ``member`` written first, as ``encode`` lays out a
    MACed message."""
    return b"{" + member + b"," + body[1:]


@st.composite
def bodies(draw: st.DrawFn, canonical: bytes, auth: bytes) -> tuple[str, bytes]:
    """``(how, body)``: the canonical bytes of a message, or a copy changed so that it parses
    to the same object (whitespace, order, escapes, duplicates of equal value), to another one,
    or to none; ``auth`` is the message's valid ``auth`` member, for a copy holding it too."""
    how = draw(
        st.sampled_from(
            (
                "same",
                "same",
                "same",
                "whitespace",
                "reordered",
                "escaped",
                "duplicate_member",
                "duplicate_auth",
                "trailing",
                "flipped",
                "truncated",
            )
        )
    )
    wire = orjson.loads(canonical)
    if how == "same":
        return how, canonical
    if how == "whitespace":
        at = draw(st.integers(1, len(canonical) - 1))
        space = draw(st.sampled_from((b" ", b"\n", b"\t", b"\r\n")))
        return how, canonical[:at] + space + canonical[at:]
    if how == "reordered":
        order = draw(st.permutations(list(wire)))
        return how, orjson.dumps({name: wire[name] for name in order})
    if how == "escaped":  # the same key, written with an escape: the same object
        return how, canonical.replace(b'"schema"', b'"sch\\u0065ma"', 1)
    if how == "duplicate_member":
        name = draw(st.sampled_from(sorted(wire)))
        value = draw(st.sampled_from((wire[name], *wire.values(), None, "x")))
        member = orjson.dumps(name) + b":" + orjson.dumps(value)
        if draw(st.booleans()):
            return how, canonical[:-1] + b"," + member + b"}"
        return how, b"{" + member + b"," + canonical[1:]
    if how == "duplicate_auth":  # a second auth member in the body: the last one wins
        if draw(st.booleans()):
            return how, canonical[:-1] + b"," + auth + b"}"
        return how, auth_first(canonical, auth)
    if how == "trailing":
        return how, canonical + draw(st.sampled_from((b" ", b"\n", b"}", b"{}", b"\x00")))
    if how == "flipped":
        at = draw(st.integers(0, len(canonical) - 1))
        flipped = bytearray(canonical)
        flipped[at] ^= draw(st.integers(1, 255))
        return how, bytes(flipped)
    assert how == "truncated"
    return how, canonical[: draw(st.integers(0, len(canonical) - 1))]


@st.composite
def maced_records(
    draw: st.DrawFn, canonical: bytes, kid: str, key: bytes, other: tuple[str, bytes]
) -> tuple[str, bytes]:
    """``(how, record value)``: a message with canonical bytes ``canonical`` MACed under
    ``(kid, key)`` as ``encode(add_mac(...))`` writes it (``how == "same/sent"``), or changed
    (module docstring); ``other`` is another key ``(kid, key)``."""
    sent = mac_of(canonical, key)
    body_how, body = draw(bodies(canonical, auth_member(kid, sent)))
    how = draw(
        st.sampled_from(
            (
                "sent",
                "sent",
                "remac",
                "other_key",
                "flip_mac",
                "flip_kid",
                "alias",
                "kid_length",
                "spaced",
                "last",
            )
        )
    )
    if how == "sent":
        member = auth_member(kid, sent)
    elif how == "remac":  # a key holder MACing the body as it is
        member = auth_member(kid, mac_of(body, key))
    elif how == "other_key":
        member = auth_member(other[0], mac_of(body, other[1]))
    elif how == "flip_mac":
        mac = bytearray(sent.encode())
        mac[draw(st.integers(0, len(mac) - 1))] = draw(st.sampled_from(B64 + b'=-_ "\\'))
        member = auth_member(kid, mac.decode())
    elif how == "flip_kid":
        kid_bytes = bytearray(kid.encode())
        kid_bytes[draw(st.integers(0, len(kid) - 1))] = draw(st.sampled_from(b"0f9aAFgz-\\"))
        member = auth_member(kid_bytes.decode(), sent)
    elif how == "alias":
        # The last digit before "=" carries 2 unused bits: setting them gives another text of
        # the same 32 bytes (the schema and base64 decoding accept it).
        index = B64.index(sent[42].encode()) ^ draw(st.integers(1, 3))
        member = auth_member(kid, sent[:42] + chr(B64[index]) + "=")
    elif how == "kid_length":
        member = auth_member(draw(st.sampled_from((kid[:-1], kid + "0", kid * 2))), sent)
    elif how == "spaced":
        member = auth_member(kid, sent, b" ")
    else:
        assert how == "last"  # the auth member after the others
        return f"{body_how}/{how}", body[:-1] + b"," + auth_member(kid, sent) + b"}"
    return f"{body_how}/{how}", auth_first(body, member)
