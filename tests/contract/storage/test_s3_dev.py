"""The session S3 server (``deploy/s3/s3-dev``, S3Proxy) is a real S3 server that fsspec can use.

Everything goes through ``fsspec.filesystem("s3")`` configured by nothing but the standard AWS
variables (``s3_env``), as trainguard's storage will be: small and multipart objects, listing,
overwrite, delete, byte ranges, and a missing key read as ``FileNotFoundError``.
"""

from __future__ import annotations

import hashlib
import random

import fsspec
import pytest
from fsspec import AbstractFileSystem

pytestmark = pytest.mark.s3

MIB = 1024 * 1024
# S3's smallest part (all parts but the last). s3fs turns a file opened for writing into a
# multipart upload once a block_size worth of bytes was written, and sends a part per block.
PART_BYTES = 5 * MIB


@pytest.fixture
def fs(s3_bucket: str) -> AbstractFileSystem:
    """``fsspec.filesystem("s3")`` built from the environment that ``s3_env`` set."""
    return fsspec.filesystem("s3")


def _blob(size: int, seed: int) -> bytes:
    """``size`` pseudo-random bytes, the same for the same ``seed``."""
    return random.Random(seed).randbytes(size)


def test_small_object_put_get_info(fs: AbstractFileSystem, s3_bucket: str) -> None:
    data = _blob(1000, seed=1)
    fs.pipe_file(f"{s3_bucket}/step-1/rank-0.bin", data)

    assert fs.cat_file(f"{s3_bucket}/step-1/rank-0.bin") == data
    assert fs.info(f"{s3_bucket}/step-1/rank-0.bin")["size"] == len(data)
    with fsspec.open(f"s3://{s3_bucket}/step-1/rank-0.bin", "rb") as handle:
        assert handle.read() == data


def test_multipart_upload_round_trips(fs: AbstractFileSystem, s3_bucket: str) -> None:
    data = _blob(2 * PART_BYTES + 123_457, seed=2)
    path = f"{s3_bucket}/big.bin"
    with fs.open(path, "wb", block_size=PART_BYTES) as handle:
        for start in range(0, len(data), MIB):
            handle.write(data[start : start + MIB])
        # Still open: the server holds an upload in progress with the parts sent so far. (Its
        # ETag cannot tell afterwards: S3Proxy's filesystem backend gives a multipart object
        # the MD5 of its bytes, not S3's "<MD5 of the part MD5s>-<parts>".)
        uploads = fs.call_s3("list_multipart_uploads", Bucket=s3_bucket).get("Uploads", [])
        assert [upload["Key"] for upload in uploads] == ["big.bin"]
        parts = fs.call_s3(
            "list_parts", Bucket=s3_bucket, Key="big.bin", UploadId=uploads[0]["UploadId"]
        )["Parts"]
        assert len(parts) >= 2
        assert all(part["Size"] >= PART_BYTES for part in parts)

    assert fs.call_s3("list_multipart_uploads", Bucket=s3_bucket).get("Uploads", []) == []
    assert fs.info(path)["size"] == len(data)
    assert hashlib.sha256(fs.cat_file(path)).digest() == hashlib.sha256(data).digest()


def test_listing_is_by_prefix_and_folder(fs: AbstractFileSystem, s3_bucket: str) -> None:
    names = ("a/1", "a/2", "a/b/3", "c")
    for name in names:
        fs.pipe_file(f"{s3_bucket}/{name}", name.encode())

    assert sorted(fs.ls(f"{s3_bucket}/a", detail=False)) == [
        f"{s3_bucket}/a/1",
        f"{s3_bucket}/a/2",
        f"{s3_bucket}/a/b",
    ]
    assert fs.isdir(f"{s3_bucket}/a/b")
    # The filesystem backend keeps a folder per "/" of a key and lists it as a placeholder key
    # ("a/"), as S3 does for folders made in the S3 console; s3fs reports those as directories.
    found = fs.find(s3_bucket, detail=True)
    assert sorted(p for p, info in found.items() if info["type"] == "file") == [
        f"{s3_bucket}/{name}" for name in names
    ]
    assert fs.du(s3_bucket) == sum(len(name) for name in names)


def test_overwrite_replaces_the_whole_object(fs: AbstractFileSystem, s3_bucket: str) -> None:
    path = f"{s3_bucket}/latest"
    fs.pipe_file(path, b"a much longer first version")
    fs.pipe_file(path, b"short")

    fs.invalidate_cache()
    assert fs.cat_file(path) == b"short"
    assert fs.info(path)["size"] == 5


def test_delete_removes_objects(fs: AbstractFileSystem, s3_bucket: str) -> None:
    for name in ("keep", "gone/1", "gone/2", "gone/deeper/3", "single"):
        fs.pipe_file(f"{s3_bucket}/{name}", b"x")

    # The files under the prefix, not its folders: S3Proxy's filesystem backend takes 10 s to
    # delete a key that names a non-empty folder (jclouds retries deleting the folder ten times,
    # a second apart), and rm(prefix, recursive=True) deletes each folder's key before its files.
    found = fs.find(f"{s3_bucket}/gone", detail=True)
    fs.rm([path for path, info in found.items() if info["type"] == "file"])  # one DeleteObjects
    fs.rm_file(f"{s3_bucket}/single")  # DeleteObject

    fs.invalidate_cache()
    assert fs.find(s3_bucket, withdirs=True) == [f"{s3_bucket}/keep"]
    assert not fs.exists(f"{s3_bucket}/gone/1")
    fs.rm_file(f"{s3_bucket}/never-was")  # deleting a missing key is no error, as on S3


def test_missing_key_raises_file_not_found(fs: AbstractFileSystem, s3_bucket: str) -> None:
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{s3_bucket}/no-such-key")
    with pytest.raises(FileNotFoundError):
        fs.info(f"{s3_bucket}/no-such-key")


def test_byte_ranges(fs: AbstractFileSystem, s3_bucket: str) -> None:
    data = _blob(PART_BYTES + 10, seed=3)
    path = f"{s3_bucket}/ranged.bin"
    fs.pipe_file(path, data)

    # cat_file(path, version_id, start, end): start and end by keyword, end exclusive.
    assert fs.cat_file(path, start=0, end=16) == data[:16]
    assert fs.cat_file(path, start=PART_BYTES - 3, end=PART_BYTES + 5) == data[-13:-5]
    assert fs.cat_file(path, start=-7) == data[-7:]
    with fs.open(path, "rb") as handle:
        handle.seek(1000)
        assert handle.read(24) == data[1000:1024]
