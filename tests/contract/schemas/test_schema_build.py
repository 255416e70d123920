"""The shipped JSON Schema files are exactly what the message dataclasses build."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Annotated

import pytest

from tests.support.schemas import SCHEMA_DIR
from trainguard.schemas import MESSAGE_TYPES
from trainguard.schemas._schema_build import _Builder, build_documents, document_bytes, main
from trainguard.schemas._wire_types import Shared, Wire


def test_every_shipped_file_is_what_the_classes_build() -> None:
    documents = build_documents()
    assert {p.stem for p in SCHEMA_DIR.glob("*.json")} == set(documents)
    stale = [
        n
        for n, d in documents.items()
        if (SCHEMA_DIR / f"{n}.json").read_bytes() != document_bytes(d)
    ]
    assert stale == [], f"run `python -m trainguard.schemas._schema_build`: {stale} differ"


def test_one_file_per_message_type_and_major_plus_the_shared_definitions() -> None:
    expected = {
        f"{c.SCHEMA.partition('/')[0]}.v{c.SCHEMA.partition('/')[2].split('.')[0]}"
        for c in MESSAGE_TYPES
    }
    assert set(build_documents()) == expected | {"common.v1"}


def test_check_names_a_stale_or_stray_file_and_write_repairs_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "json"
    shutil.copytree(SCHEMA_DIR, folder)
    (folder / "heartbeat.v1.json").write_text('{"type": "object"}\n')
    (folder / "stray.v1.json").write_text("{}\n")
    assert main(["--check", "--folder", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "heartbeat.v1.json differs" in err
    assert "stray.v1.json differs" in err
    assert main(["--folder", str(folder)]) == 0
    assert not (folder / "stray.v1.json").exists()
    assert main(["--check", "--folder", str(folder)]) == 0


Counter = Annotated[int, Shared("count", "A count.", minimum=0)]


@dataclasses.dataclass(frozen=True)
class Example:
    n: Annotated[Counter, Wire("How many.")]
    size: Annotated[int | None, Wire("Bytes.", minimum=1)] = None
    names: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Complex:
    z: complex


@dataclasses.dataclass(frozen=True)
class Unlisted:
    x: Annotated[int, Shared("nowhere", "Not shared.")]


def test_a_field_is_built_from_its_type_default_and_wire_metadata() -> None:
    node = _Builder("c.json").object(Example, "An example.")
    assert node["required"] == ["n"]
    assert node["properties"] == {
        "n": {"description": "How many.", "$ref": "c.json#/$defs/count"},
        "size": {
            "description": "Bytes.",
            "type": ["integer", "null"],
            "minimum": 1,
            "default": None,
        },
        "names": {"type": "array", "items": {"type": "string"}, "default": []},
    }


def test_a_type_without_a_json_form_or_an_unlisted_shared_type_is_refused() -> None:
    with pytest.raises(TypeError, match="no JSON Schema for <class 'complex'>"):
        _Builder("").object(Complex, "")
    with pytest.raises(TypeError, match="'nowhere' is not listed in SHARED_TYPES"):
        _Builder("").object(Unlisted, "")
