"""Dataset manifests and versions: stable across runs and places, sensitive to any change."""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainguard.agent.data._dataset_version import ManifestEntry, dataset_manifest, dataset_version

FILES = {
    "train/part-0.bin": b"\x00\x01" * 1000,
    "train/part-1.bin": b"second shard",
    "train/sub dir/é.txt": b"non-ascii name",
    ".hidden": b"dot file",
    "README": b"",
}


def make_dataset(root: Path, files: dict[str, bytes] = FILES) -> Path:
    for name, content in reversed(files.items()):  # creation order must not matter
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root


def test_manifest_lists_every_file_sorted_with_size_and_sha256(tmp_path: Path) -> None:
    manifest = dataset_manifest(make_dataset(tmp_path))
    assert manifest == [
        ManifestEntry(name, len(content), hashlib.sha256(content).hexdigest())
        for name, content in sorted(FILES.items())
    ]


def test_version_is_stable_across_runs_and_locations(tmp_path: Path) -> None:
    here = make_dataset(tmp_path / "a")
    there = tmp_path / "elsewhere" / "b"
    shutil.copytree(here, there)
    os.utime(there / "README", (0, 0))  # modification times do not count
    version = dataset_version(dataset_manifest(here))
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", version)
    assert dataset_version(dataset_manifest(here)) == version
    assert dataset_version(dataset_manifest(str(there))) == version


def test_version_is_pinned(tmp_path: Path) -> None:
    """The canonical serialisation is part of the format: old checkpoints name these digests."""
    make_dataset(tmp_path, {"a.txt": b"alpha", "dir/b.bin": b"beta"})
    assert dataset_version(dataset_manifest(tmp_path)) == (
        "sha256:" + hashlib.sha256(PINNED_TEXT.encode()).hexdigest()
    )


PINNED_TEXT = (
    "trainguard-dataset-manifest/1\n"
    '["a.txt",5,"8ed3f6ad685b959ead7022518e1af76cd816f8e8ec7ccdda1ed4018e8f2223f8"]\n'
    '["dir/b.bin",4,"f44e64e75f3948e9f73f8dfa94721c4ce8cbb4f265c4790c702b2d41cfbf2753"]'
)


@pytest.mark.parametrize(
    "change",
    ["content", "rename", "move", "add", "remove", "empty"],
)
def test_version_changes_with_any_file_change(tmp_path: Path, change: str) -> None:
    root = make_dataset(tmp_path)
    before = dataset_version(dataset_manifest(root))
    target = root / "train/part-1.bin"
    if change == "content":
        target.write_bytes(b"SECOND shard")  # same size
    elif change == "rename":
        target.rename(root / "train/part-9.bin")
    elif change == "move":
        target.rename(root / "part-1.bin")
    elif change == "add":
        (root / "train/part-2.bin").write_bytes(b"")
    elif change == "remove":
        target.unlink()
    else:
        target.write_bytes(b"")
    assert dataset_version(dataset_manifest(root)) != before


def test_pattern_selects_files(tmp_path: Path) -> None:
    root = make_dataset(tmp_path)
    manifest = dataset_manifest(root, "train/*.bin")
    assert [e.path for e in manifest] == ["train/part-0.bin", "train/part-1.bin"]


def test_file_list_matches_the_directory_walk(tmp_path: Path) -> None:
    root = make_dataset(tmp_path)
    files = [root / name for name in FILES]
    assert dataset_manifest(files, root=root) == dataset_manifest(root)
    shards: list[str | Path] = [root / "train/part-1.bin", str(root / "train/part-0.bin")]
    assert [e.path for e in dataset_manifest(shards)] == ["part-0.bin", "part-1.bin"]


def test_large_files_are_hashed_whole(tmp_path: Path) -> None:
    content = os.urandom(3 * 2**20 + 17)
    (tmp_path / "big").write_bytes(content)
    (entry,) = dataset_manifest(tmp_path)
    assert entry == ManifestEntry("big", len(content), hashlib.sha256(content).hexdigest())


def test_manifest_rejects_bad_sources(tmp_path: Path) -> None:
    root = make_dataset(tmp_path / "data")
    with pytest.raises(FileNotFoundError, match="no dataset file"):
        dataset_manifest(root, "*.parquet")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        dataset_manifest(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="not a regular file"):
        dataset_manifest([tmp_path / "missing"])
    with pytest.raises(ValueError, match="not a regular file"):
        dataset_manifest([root / "train"])
    with pytest.raises(ValueError, match="outside the root"):
        dataset_manifest([root / "README"], root=root / "train")
    with pytest.raises(ValueError, match="relative path"):
        dataset_manifest([root / "README", root / "train" / ".." / "README"], root=root)
    with pytest.raises(ValueError, match="pattern"):
        dataset_manifest([root / "README"], "*")
    with pytest.raises(ValueError, match="root"):
        dataset_manifest(root, root=root)


FIELDS = {
    "path": st.text(min_size=1, max_size=20),
    "size_bytes": st.integers(0, 2**40),
    "sha256": st.text("0123456789abcdef", min_size=64, max_size=64),
}
manifests = st.lists(
    st.builds(ManifestEntry, **FIELDS), min_size=1, max_size=8, unique_by=lambda e: e.path
)


@given(manifests, st.randoms())
def test_version_ignores_entry_order(manifest: list[ManifestEntry], rnd: random.Random) -> None:
    shuffled = list(manifest)
    rnd.shuffle(shuffled)
    assert dataset_version(shuffled) == dataset_version(manifest)


@given(manifests, st.data())
def test_version_sees_every_field_of_every_entry(
    manifest: list[ManifestEntry], data: st.DataObject
) -> None:
    index = data.draw(st.integers(0, len(manifest) - 1))
    field = data.draw(st.sampled_from(sorted(FIELDS)))
    old = getattr(manifest[index], field)
    new: Any = data.draw(FIELDS[field].filter(lambda value: value != old))
    changed = [*manifest[:index], manifest[index]._replace(**{field: new}), *manifest[index + 1 :]]
    assert dataset_version(changed) != dataset_version(manifest)


def test_a_user_version_id_is_used_as_is() -> None:
    assert dataset_version("lakefs:main@5f3c2a") == "lakefs:main@5f3c2a"
    for bad in ["", " padded", "x" * 256]:
        with pytest.raises(ValueError, match="data version id"):
            dataset_version(bad)
    with pytest.raises(ValueError, match="empty manifest"):
        dataset_version([])
