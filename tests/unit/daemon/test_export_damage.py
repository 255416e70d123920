"""Damaged export files (``trainguard export``'s format): refused with a clear reason when read
whole (``load``) and raised where the reading reaches the damage when streamed
(``EventStream``, in the calling process); a damaged byte anywhere in the compressed stream is
named as gzip damage."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.export_files import DAMAGES, export_header, export_record
from trainguard.agent.bus import Record
from trainguard.daemon.forensics._export_file import MalformedExport, dump, load
from trainguard.daemon.forensics._export_stream import EventStream


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_file_is_refused_with_a_clear_reason(damage: str, tmp_path: Path) -> None:
    path = tmp_path / "job.tgjsonl.gz"
    dump(path, export_header(), {"events": [export_record(0), export_record(1)]})
    load(path)  # intact
    change, reason = DAMAGES[damage]
    change(path)
    with pytest.raises(MalformedExport, match=r"job\.tgjsonl\.gz") as caught:
        load(path)
    assert reason in str(caught.value)


def test_a_damaged_byte_anywhere_in_the_compressed_stream_is_named_as_such(
    tmp_path: Path,
) -> None:
    """Garbage decompressed from a damaged byte (a line that is not JSON, or records that look
    valid but break an order or a count) is reported as the gzip damage it comes from."""
    path = tmp_path / "job.tgjsonl.gz"
    dump(path, export_header(), {"events": [export_record(i) for i in range(200)]})
    intact = path.read_bytes()
    gzip_header, trailer = 10, 8
    for position in range(gzip_header, len(intact), 3):
        damaged = bytearray(intact)
        damaged[position] ^= 0xFF
        path.write_bytes(bytes(damaged))
        with pytest.raises(MalformedExport) as caught:
            load(path)
        assert "not a complete gzip file" in str(caught.value), (position, str(caught.value))
    assert len(intact) - trailer > gzip_header


# -- streamed ----------------------------------------------------------------------------------


def _stream_all(path: Path, process: bool) -> list[Record]:
    with EventStream(path, process=process) as stream:
        return list(stream)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damage_is_raised_where_the_reading_reaches_it(damage: str, tmp_path: Path) -> None:
    path = tmp_path / "job.tgjsonl.gz"
    dump(path, export_header(), {"events": [export_record(0), export_record(1)]})
    assert _stream_all(path, process=False) == load(path)[1]["events"]
    change, reason = DAMAGES[damage]
    change(path)
    with pytest.raises(MalformedExport, match=r"job\.tgjsonl\.gz") as caught:
        _stream_all(path, process=False)
    assert reason in str(caught.value)


def test_an_unreadable_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing"):
        EventStream(tmp_path / "missing.tgjsonl.gz")
