"""Tests of the job-state codec (``jobstate/1``): malformed documents raise
:class:`StateFormatError` naming the value's path, every field type has a form, and documents
of earlier layouts decode with the new fields at their defaults. (The exact round trips over
simulated jobs are property tests: ``tests/properties/test_state_codec_round_trips.py``.)"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import structs
from rpds import HashTrieMap, HashTrieSet

from tests.support.machine_scenarios import (
    AWAY,
    T0,
    S,
    Sim,
    config,
    killed_in_an_outage,
    killed_job,
    run,
    two_ranks_training,
)
from trainguard.daemon.core._inputs import Input
from trainguard.daemon.core._state import (
    JobState,
    Left,
    new_job,
)
from trainguard.daemon.core._state_codec import (
    LAYOUT,
    READABLE_LAYOUTS,
    StateFormatError,
    _form,
    decode_state,
    encode_state,
    state_from_dict,
)

# -- strict decoding ---------------------------------------------------------------------------


def recovering_state() -> JobState:
    """A 4-rank job killed after 38 steps, three of whose ranks restarted and acknowledged the
    restore: committed manifests, an incident with a target and acknowledgements, ranks and
    senders of the new generation."""
    sim, state, restore = killed_job()
    state, _ = run(sim.recover(restore, state.clock_ns + S, ranks=[0, 1, 2]), state)
    return state


def recovering_document() -> dict[str, Any]:
    document: dict[str, Any] = orjson.loads(encode_state(recovering_state()))
    return document


def put(document: dict[str, Any], path: Sequence[str | int], value: Any) -> dict[str, Any]:
    """A copy of ``document`` with the value at ``path`` replaced (a new key if absent)."""
    changed = copy.deepcopy(document)
    node: Any = changed
    for token in path[:-1]:
        node = node[token]
    node[path[-1]] = value
    return changed


def drop(document: dict[str, Any], path: Sequence[str | int]) -> dict[str, Any]:
    changed = copy.deepcopy(document)
    node: Any = changed
    for token in path[:-1]:
        node = node[token]
    del node[path[-1]]
    return changed


def refused(document: object) -> StateFormatError:
    with pytest.raises(StateFormatError) as caught:
        state_from_dict(document)
    # The same through the bytes, when the document has a JSON form.
    with pytest.raises(StateFormatError) as via_bytes:
        decode_state(orjson.dumps(document))
    assert via_bytes.value.path == caught.value.path
    return caught.value


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (["state", "generation"], "1", "state.generation"),
        (["state", "generation"], True, "state.generation"),
        (["state", "generation"], 1.0, "state.generation"),
        (["state", "clock_ns"], 1.8e19, "state.clock_ns"),
        (["state", "phase"], "paused", "state.phase"),
        (["state", "phase"], ["running"], "state.phase"),
        (["state", "ranks", 0, 1, "status"], "zombie", "state.ranks[0][1].status"),
        (["state", "ranks", 2, 1, "step_time_s"], "NaN", "state.ranks[2][1].step_time_s"),
        (["state", "ranks", 0], [0], "state.ranks[0]"),
        (["state", "ranks", 1, 0], 0, "state.ranks[1][0]"),  # the key of entry 0 again
        (["state", "ranks", 2, 1], [], "state.ranks[2][1]"),
        (["state", "senders", 0, 0], [0, "h0"], "state.senders[0][0]"),
        (["state", "senders", 0, 0, 1], 7, "state.senders[0][0][1]"),
        (["state", "committed", 0, "step"], "7", "state.committed[0].step"),
        (["state", "committed", 1, "manifest_digest"], 5, "state.committed[1].manifest_digest"),
        (["state", "committed", 0, "cursor", "seed"], "7", "state.committed[0].cursor.seed"),
        (["state", "committed", 0, "cursor"], None, "state.committed[0].cursor"),
        (["state", "committed"], {"0": None}, "state.committed"),
        (["state", "incident", "acks", 1, 0], 0, "state.incident.acks[1][0]"),
        (["state", "incident", "acks"], [1.0], "state.incident.acks[0]"),
        (
            ["state", "incident", "acks", 0, 1, "cursor", "seed"],
            "7",
            "state.incident.acks[0][1].cursor.seed",
        ),
        (["state", "incident", "skip"], {"from_step": 1}, "state.incident.skip.to_step"),
        (["state", "incident", "cause"], "boredom", "state.incident.cause"),
        (["state", "trend", "step_times", "recent"], ["fast"], "state.trend.step_times.recent[0]"),
        (["state", "loop", "incidents"], [["job/i1"]], "state.loop.incidents[0]"),
        (["state", "bad_snapshots"], "job/g0/s10", "state.bad_snapshots"),
        (["state", "bad_snapshots"], [["a", "why"], "a"], "state.bad_snapshots[1]"),
        (["state", "watch", "extra"], 1, "state.watch.extra"),
        (["state", "watch", "spike"], {}, "state.watch.spike.onset_after_step"),
        (["state"], [], "state"),
        (["format"], "jobstate/2", "format"),
        (["layout"], "0" * 16, "layout"),
        (["signature"], "", "signature"),
    ],
)
def test_a_malformed_value_is_refused_with_its_path(
    path: list[str | int], value: Any, where: str
) -> None:
    """``where`` is the path named, or its beginning when it ends with ``*`` (the schemas codec
    names the field inside a message)."""
    error = refused(put(recovering_document(), path, value))
    assert isinstance(error, ValueError)
    assert error.reason
    if where.endswith("*"):
        assert (error.path or "").startswith(where[:-1])
    else:
        assert error.path == where


@pytest.mark.parametrize(
    ("path", "where"),
    [
        (["state", "watch", "agreed"], "state.watch.agreed"),
        (["state", "incident", "acks"], "state.incident.acks"),
        (["state", "committed", 0, "manifest_digest"], "state.committed[0].manifest_digest"),
        (["state"], "state"),
        (["format"], "format"),
        (["layout"], "layout"),
    ],
)
def test_a_missing_field_is_refused_with_its_path(path: list[str | int], where: str) -> None:
    assert refused(drop(recovering_document(), path)).path == where


@pytest.mark.parametrize(
    "data", [b"", b"not json", b"[]", b'"jobstate/1"', b"\xff\xfe", b'{"format": "jobstate/1"']
)
def test_bytes_that_are_no_document_are_refused(data: bytes) -> None:
    with pytest.raises(StateFormatError) as caught:
        decode_state(data)
    assert caught.value.path in (None, "format")


def test_an_integer_beyond_64_bits_is_refused_both_ways() -> None:
    document = put(recovering_document(), ["state", "clock_ns"], 2**64)
    assert refused_python(document) == "state.clock_ns"
    with pytest.raises(StateFormatError) as caught:
        encode_state(structs.replace(recovering_state(), command_seq=2**64))
    assert caught.value.path == "state.command_seq"


def refused_python(document: dict[str, Any]) -> str | None:
    """The path of the error for a document with no JSON form (a Python dict only)."""
    with pytest.raises(StateFormatError) as caught:
        state_from_dict(document)
    return caught.value.path


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda s: structs.replace(s, committed=list(s.committed)), "state.committed"),
        (lambda s: structs.replace(s, generation=True), "state.generation"),
        (lambda s: structs.replace(s, bad_snapshots={"x"}), "state.bad_snapshots"),
        (lambda s: structs.replace(s, ranks=dict(s.ranks)), "state.ranks"),
        (lambda s: structs.replace(s, phase="paused"), "state.phase"),
        (
            lambda s: structs.replace(s, senders=s.senders.insert((0, 1, 2), 0)),
            "state.senders[0][0][1]",
        ),
        (
            lambda s: structs.replace(s, committed=(replace(s.committed[0], step="7"),)),
            "state.committed[0].step",
        ),
        (lambda s: structs.replace(s, failure="\ud800"), "state"),
    ],
)
def test_a_state_with_a_value_its_types_forbid_is_not_encoded(
    change: Callable[[JobState], JobState], where: str
) -> None:
    """The encoder checks what it writes (the schemas codec checks the messages), so whatever
    it writes decodes to the same state."""
    with pytest.raises(StateFormatError) as caught:
        encode_state(change(recovering_state()))
    assert caught.value.path == where


# A JSON value of any shape, to put anywhere in a valid document.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["nan", "inf", "alive", "running", "manifest/1.0"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


def node_paths(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Paths of every value in a parsed JSON document (the document itself excluded)."""
    found: list[tuple[str | int, ...]] = [path] if path else []
    items: Iterable[tuple[str | int, Any]] = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    for key, child in items:
        found += node_paths(child, (*path, key))
    return found


DOCUMENT = recovering_document()
DOCUMENT_PATHS = node_paths(DOCUMENT)


@settings(max_examples=150, deadline=None)
@given(index=st.integers(0, len(DOCUMENT_PATHS) - 1), value=json_values)
def test_any_change_decodes_or_raises_the_format_error(index: int, value: Any) -> None:
    """Whatever value replaces whatever part of a valid document, decoding either gives a
    state that encodes again or raises :class:`StateFormatError`; no other error escapes."""
    data = orjson.dumps(put(DOCUMENT, DOCUMENT_PATHS[index], value))
    try:
        state = decode_state(data)
    except StateFormatError:
        return
    assert decode_state(encode_state(state)) == state


# -- the type dispatch -------------------------------------------------------------------------


class Counts(NamedTuple):
    by_host: dict[str, int]


class Mixed(NamedTuple):
    either: int | str


class Listed(NamedTuple):
    ranks: HashTrieSet[int]
    steps: list[int]


@pytest.mark.parametrize(
    ("cls", "field"),
    [(Counts, "Counts.by_host"), (Mixed, "Mixed.either"), (Listed, "Listed.steps")],
)
def test_a_field_type_without_a_form_is_refused_when_the_codec_is_built(
    cls: type[Any], field: str
) -> None:
    """A state field of a type the codec has no form for fails loudly, naming the field: since
    the codec is built from ``JobState`` at import, such a field added to the state makes this
    module (and the daemon) fail to import rather than write snapshots that lose it."""
    with pytest.raises(TypeError, match=field):
        _form(cls)


OLD_LAYOUT = Path(__file__).with_name("data") / "jobstate-c35900be070fb0d2.json"
"""``encode_state`` of the build before the bus-outage rule (layout c35900be070fb0d2, without
``JobState.settle_until_ns``, ``held`` and ``left``) for a 2-rank job killed after step 11."""

BEFORE_LEFT = Path(__file__).with_name("data") / "jobstate-ef5317866765d48d.json"
"""The same state written by the build before the late-finish rule (layout ef5317866765d48d,
without ``JobState.left``)."""


BEFORE_CUTS = Path(__file__).with_name("data") / "jobstate-0c4b9a05468dc2f8.json"
"""The same state written by the build before the late-cut rule (layout 0c4b9a05468dc2f8,
without ``Left.pending`` and ``Left.cuts``): its ``left`` is set (the restore left generation 0)."""


def old_layout_inputs() -> list[Input]:
    """The inputs the states of :data:`OLD_LAYOUT`, :data:`BEFORE_LEFT` and :data:`BEFORE_CUTS`
    were folded from."""
    sim = Sim(world_size=2)
    return [*sim.start(T0), *sim.train(range(12), start=T0 + S), sim.kill(1, T0 + 13 * S)]


@pytest.mark.parametrize("path", [OLD_LAYOUT, BEFORE_LEFT], ids=lambda p: p.stem)
def test_a_document_of_an_earlier_layout_decodes_with_the_new_fields_at_their_defaults(
    path: Path,
) -> None:
    """A snapshot written before this build added ``settle_until_ns``, ``held`` or ``left``
    reads back as the state this build folds from the same inputs, those fields at their
    defaults: a restore issued by an older build recorded no generation it left (its late
    ``finished`` reports stay stale, as that build judged them)."""
    data = path.read_bytes()
    layout = orjson.loads(data)["layout"]
    assert layout != LAYOUT
    assert layout in READABLE_LAYOUTS
    state = decode_state(data)
    assert (state.settle_until_ns, state.held, state.left) == (None, None, None)
    folded, _ = run(old_layout_inputs())
    assert folded.left is not None
    folded = structs.replace(folded, left=None)
    assert state == folded
    assert encode_state(state) == encode_state(folded)


def test_a_document_of_the_layout_before_late_cuts_decodes_with_an_empty_left_record() -> None:
    """A snapshot written before ``Left`` gained ``pending`` and ``cuts`` reads back as the
    state this build folds from the same inputs (which pend no shard when the restore leaves
    generation 0): the generation left, no shard of it pending, no cut; a ``left`` that
    already has one of the new fields is not of that layout."""
    data = BEFORE_CUTS.read_bytes()
    document = orjson.loads(data)
    assert document["layout"] != LAYOUT
    assert document["layout"] in READABLE_LAYOUTS
    assert set(document["state"]["left"]) == {"generation", "finished"}
    state = decode_state(data)
    assert state.left == Left(generation=0, finished=(), pending=HashTrieMap(), cuts=())
    folded, _ = run(old_layout_inputs())
    assert state == folded
    assert encode_state(state) == encode_state(folded)
    document["state"]["left"]["cuts"] = []
    assert refused(document).path == "state.left.cuts"


BEFORE_DONE = Path(__file__).with_name("data") / "jobstate-7418d36e93a15e6c.json"
"""``encode_state`` of the build before the ranks' own dating of their steps (layout
7418d36e93a15e6c, without ``JobState.last_gap`` and ``RankState.step_done_ns``) for a 2-rank
job training through step 30 (``two_ranks_training``)."""


def test_a_document_before_step_done_decodes_with_each_rank_s_deadline_date() -> None:
    """A snapshot of a running job written before ``RankState.step_done_ns`` reads back with
    each rank's step completion dated as its deadline (``step_advanced_ns``) and no gap: here
    the state this build folds from the same inputs (heartbeats on time, nothing in the agents'
    queues). A rank that already has the new field is not of that layout."""
    data = BEFORE_DONE.read_bytes()
    document = orjson.loads(data)
    assert document["layout"] != LAYOUT
    assert document["layout"] in READABLE_LAYOUTS
    state = decode_state(data)
    assert state.last_gap is None
    assert [r.step_done_ns for r in state.ranks.values()] == [
        r.step_advanced_ns for r in state.ranks.values()
    ]
    assert all(r.step_done_ns is not None for r in state.ranks.values())
    folded, _ = run(two_ranks_training(Sim(world_size=2), 30), cfg=config())
    assert state == folded
    assert encode_state(state) == encode_state(folded)
    document["state"]["ranks"][1][1]["step_done_ns"] = None
    assert refused(document).path == "state.ranks[1][1].step_done_ns"


BEFORE_LATE = Path(__file__).with_name("data") / "jobstate-6fb9639cf1123afa.json"
"""``encode_state`` of the build before the ranks' lateness (layout 6fb9639cf1123afa, without
``RankState.late_ns``) for a 2-rank job training through step 30 (``two_ranks_training``)."""


def test_a_document_before_late_decodes_with_every_rank_on_time() -> None:
    """A snapshot of a running job written before ``RankState.late_ns`` reads back with every
    rank on time: here the state this build folds from the same inputs (every event on time).
    A rank that already has the new field is not of that layout; the earlier layouts get it
    too."""
    data = BEFORE_LATE.read_bytes()
    document = orjson.loads(data)
    assert document["layout"] != LAYOUT
    assert document["layout"] in READABLE_LAYOUTS
    state = decode_state(data)
    assert [r.late_ns for r in state.ranks.values()] == [0, 0]
    folded, _ = run(two_ranks_training(Sim(world_size=2), 30), cfg=config())
    assert state == folded
    assert encode_state(state) == encode_state(folded)
    assert decode_state(BEFORE_DONE.read_bytes()) == folded
    document["state"]["ranks"][0][1]["late_ns"] = 0
    assert refused(document).path == "state.ranks[0][1].late_ns"


BEFORE_AWAITS = Path(__file__).with_name("data") / "jobstate-229cdba23e078b61.json"
"""``encode_state`` of the build before the hold for a checkpoint in flight (layout
229cdba23e078b61, without ``Held.awaits``) for a 2-rank job whose rank 1 was killed in an
outage (``killed_in_an_outage``), up to the exit report: its restore held while the bus
settles."""


def test_a_document_before_awaits_decodes_with_its_hold_waiting_for_the_bus() -> None:
    data = BEFORE_AWAITS.read_bytes()
    document = orjson.loads(data)
    assert document["layout"] != LAYOUT
    assert document["layout"] in READABLE_LAYOUTS
    state = decode_state(data)
    sim = Sim(world_size=2)
    inputs = killed_in_an_outage(sim)
    cut = next(n for n, i in enumerate(inputs) if i.at_ns >= AWAY[1]) + 1
    folded, _ = run(inputs[:cut], cfg=config())
    assert folded.held is not None
    assert folded.held.awaits is None
    assert state == folded
    document["state"]["held"]["awaits"] = None
    assert refused(document).path == "state.held.awaits"


def test_a_document_of_the_old_layout_with_the_new_fields_is_refused() -> None:
    document = orjson.loads(OLD_LAYOUT.read_bytes())
    document["state"]["held"] = None
    with pytest.raises(StateFormatError) as caught:
        state_from_dict(document)
    assert caught.value.path == "state.held"
    document = orjson.loads(OLD_LAYOUT.read_bytes())
    document["layout"] = "1" * 16
    assert refused(document).path == "layout"


def test_the_layout_changes_with_the_state_classes() -> None:
    """Two classes that differ in one field's type or name have different shapes."""

    class A(NamedTuple):
        step: int

    class B(NamedTuple):
        step: float

    class C(NamedTuple):
        steps: int

    shapes = {_form(cls).shape.partition("(")[2] for cls in (A, B, C)}
    assert len(shapes) == 3


BEFORE_REFS = Path(__file__).with_name("data") / "jobstate-4249f0793ee82f05.json"
"""``encode_state`` of the build before snapshot references (layout 4249f0793ee82f05, whole
manifests as the committed snapshots and the incident's target) of :func:`recovering_state`:
three snapshots committed, a restore to the newest acknowledged by three of four ranks."""


def test_a_document_with_whole_manifests_decodes_with_their_references() -> None:
    """A snapshot written while the state kept whole manifests (one shard per rank) reads back
    as the state this build folds from the same inputs: each manifest is now its reference,
    whose digest is that of the manifest's stored head; every earlier layout gets the same."""
    data = BEFORE_REFS.read_bytes()
    document = orjson.loads(data)
    assert document["layout"] != LAYOUT
    assert document["layout"] in READABLE_LAYOUTS
    assert "shards" in document["state"]["committed"][0]
    state = decode_state(data)
    folded = recovering_state()
    assert state == folded
    assert encode_state(state) == encode_state(folded)
    assert state.incident is not None
    assert state.incident.target == state.committed[-1]
    document["state"]["committed"][0]["shards"][0]["digest"] = "md5:00"
    assert str(refused(document).path).startswith("state.committed[0].shards[0]")


BEFORE_RELAYS = Path(__file__).with_name("data") / "jobstate-d0c702ce91cc15cb.json"
"""``encode_state`` of the build before the batches' own seq (layout d0c702ce91cc15cb, without
``JobState.relays``) for a 2-rank job training through step 30 (``two_ranks_training``)."""


def test_a_document_before_relays_decodes_with_no_batch_noted() -> None:
    """A snapshot written before ``JobState.relays`` reads back with no supervisor's batch
    noted: here the state this build folds from the same (unbatched) inputs. A document of
    that layout that has the field is refused; every earlier layout gets it too."""
    data = BEFORE_RELAYS.read_bytes()
    document = orjson.loads(data)
    assert document["layout"] != LAYOUT
    assert document["layout"] in READABLE_LAYOUTS
    state = decode_state(data)
    folded, _ = run(two_ranks_training(Sim(world_size=2), 30), cfg=config())
    assert state == folded
    assert encode_state(state) == encode_state(folded)
    assert decode_state(BEFORE_LATE.read_bytes()).relays == HashTrieMap()
    document["state"]["relays"] = []
    assert refused(document).path == "state.relays"


def test_the_batches_noted_read_back() -> None:
    """The highest batch ``seq`` of each supervisor (``(host, pid)`` keys) reads back as
    written."""
    state = structs.replace(new_job("job"), relays=HashTrieMap({("h0", 7): 12, ("h1", 8): 3}))
    assert decode_state(encode_state(state)) == state
