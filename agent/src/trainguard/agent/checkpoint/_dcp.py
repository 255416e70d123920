"""DCP checkpoints (``torch.distributed.checkpoint``) whose every byte is digested and verified.

A DCP checkpoint of a step is one folder: each rank writes ``__<rank>_<n>.distcp`` with the
tensors it owns, and the coordinator (rank 0) writes ``.metadata``, the plan that maps every
tensor (and every shard of a DTensor) to an offset and a length in those files. DCP loads it
onto any mesh, so a snapshot written by N ranks restores onto M (resharding); any DCP reader
(torchtitan, ``torch.distributed.checkpoint.format_utils``) can read it.

What trainguard adds, at the storage layer DCP leaves open (``FileSystemBase``):

* **Digests recorded with the write.** Every stream DCP opens for writing passes through a
  hashing stream, so each file's SHA-256 and size are known when it is closed, without reading
  it back (:class:`DigestingFileSystem`). The rank announces its files with their digests;
  rank 0's include ``.metadata``.
* **Verified before deserialized.** On a restore every file is read whole, checked against the
  manifest's digest and size, and only then handed to DCP (which unpickles ``.metadata`` and
  ``torch.load``\\ s the items) as an in-memory stream. A file the manifest does not list is
  refused. So a flipped byte, a truncated or missing file, or a file replaced by a malicious
  pickle never reaches ``pickle`` or ``torch.load``. The price: a rank holds each file it reads
  in memory once, and reads a whole file even when it needs only a slice of it (resharding).
* **The agent's per-rank state** (RNG states, cursor, step) goes into a small
  ``trainguard.rank<rank:05>.pt`` beside the DCP files, digested the same way, so the DCP
  folder holds exactly the user's state dict and other tools read it as is.

Storage is named by URI: ``file://`` through DCP's ``FileSystemWriter``/``FileSystemReader``,
anything else through fsspec (DCP's ``FsspecWriter``/``FsspecReader``; ``s3://`` with s3fs),
with credentials from that library's usual environment and configuration. Object stores have
no atomic rename; that is fine, because a restore reads only a snapshot the daemon committed,
and only the bytes its manifest's digests vouch for.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote, urlsplit

from trainguard.agent._errors import ShardCorrupt, ShardError, ShardMissing
from trainguard.agent.checkpoint._layout import storage_errors
from trainguard.agent.checkpoint._shards import load_verified_dict
from trainguard.agent.checkpoint._snapshot import Snapshot
from trainguard.agent.checkpoint._zip_crc import zip_crc_off
from trainguard.schemas import Shard, StoredFile, files_digest

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.filesystem import FileSystemBase
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

__all__ = [
    "METADATA",
    "DcpWrite",
    "DigestingFileSystem",
    "dcp_files",
    "dcp_problems",
    "load_dcp",
    "sidecar_name",
    "step_folder_uri",
    "storage_writer",
]

METADATA = ".metadata"
"""The DCP coordinator's file (written by rank 0)."""


def sidecar_name(rank: int) -> str:
    """``trainguard.rank<rank:05>.pt``: the agent's own state of ``rank`` in a DCP folder."""
    return f"trainguard.rank{rank:05d}.pt"


def step_folder_uri(base_uri: str, job_id: str, generation: int, step: int) -> str:
    """The DCP folder of ``step`` written in ``generation``:
    ``<base_uri>/<job_id>/g<generation:06>/s<step:010>`` (the layout of ``torch.save`` shards,
    so retention and the catalog treat both alike)."""
    return f"{base_uri.rstrip('/')}/{job_id}/g{generation:06d}/s{step:010d}"


def _is_local(uri: str) -> bool:
    return urlsplit(uri).scheme == "file"


def _local_path(uri: str) -> Path:
    return Path(unquote(urlsplit(uri).path))


class _Ledger:
    """The files one save wrote: name -> :class:`StoredFile` (thread-safe: DCP may write from
    several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, StoredFile] = {}

    def record(self, name: str, size: int, digest: str) -> None:
        with self._lock:
            self._files[name] = StoredFile(name=name, size_bytes=size, digest=digest)

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            stored = self._files.pop(old, None)
            if stored is not None:
                self._files[new] = StoredFile(
                    name=new, size_bytes=stored.size_bytes, digest=stored.digest
                )

    def files(self) -> tuple[StoredFile, ...]:
        with self._lock:
            return tuple(sorted(self._files.values(), key=lambda f: f.name))


_CHUNK_BYTES = 1 << 20
"""The hashing thread's unit of work: a copy of this many consecutive bytes of a stream (small
enough to be in the CPU's cache still when it is written and hashed: 1 MiB measured faster than
256 KiB and 4 MiB, ``bench/checkpoint.py`` part 2)."""

_POOL_CHUNKS = 128
"""At most this many chunks (128 MiB) are waiting to be hashed, in all streams of a process."""


class _ChunkPool:
    """Reusable chunk buffers, shared by every stream of the process.

    A buffer is allocated the first time one is needed and none is free, up to ``limit``;
    after that ``take`` waits for one to be given back (a stream holds at most one partly
    filled buffer, and DCP writes a rank's files with one thread, two at most here: far from
    the limit). Reused buffers are the point: a
    fresh 1 MiB allocation is a fresh mapping whose first touch costs a page fault per 4 KiB,
    more than the copy itself (``bench/checkpoint.py``, part 2). The free buffers are a stack:
    the one given back last, just hashed and still in the CPU's cache, is taken first.
    """

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self._limit = limit
        self._made = 0
        self._given = threading.Condition()
        self._free: list[bytearray] = []

    def take(self) -> bytearray:
        """A buffer of ``size`` bytes (blocks while ``limit`` buffers are in use)."""
        with self._given:
            if not self._free and self._made < self._limit:
                self._made += 1
                return bytearray(self.size)
            self._given.wait_for(lambda: bool(self._free))
            return self._free.pop()

    def give(self, buffer: bytearray) -> None:
        """Return a buffer taken with :meth:`take`."""
        with self._given:
            self._free.append(buffer)
            self._given.notify()


_POOL = _ChunkPool(_CHUNK_BYTES, _POOL_CHUNKS)


class _HashingStream(io.RawIOBase):
    """A write stream that hashes and counts what passes through to ``raw``.

    ``tell`` is the count (the stream was opened empty, for writing), which is all DCP asks of
    it besides ``write``, ``flush``, ``fileno`` (for ``fsync``) and ``close``.

    The hashing runs on a helper thread, behind the writes: ``write`` copies the bytes into
    pooled chunk buffers (DCP hands it views of tensor storage that are valid only during the
    call), writes them to ``raw`` from there, hands each full chunk to the helper and returns. ``hashlib`` releases the GIL, so
    the digest overlaps DCP's serialization, the writes and the ``fsync``; ``close`` waits
    for the last chunk. The digest is the plain SHA-256 of the stream (``sha256sum`` of the
    file). The pool bounds the bytes waiting to be hashed; ``write`` waits when it is empty.
    """

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self._raw = raw
        self._sha = hashlib.sha256()
        self.size = 0
        self._hasher: ThreadPoolExecutor | None = None
        self._hashed: list[Future[None]] = []
        self._chunk: bytearray | None = None
        self._filled = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if self._chunk is None:
                self._chunk, self._filled = _POOL.take(), 0
            take = min(len(view) - done, _POOL.size - self._filled)
            piece = memoryview(self._chunk)[self._filled : self._filled + take]
            piece[:] = view[done : done + take]
            # Written from the copy, still in the CPU's cache: the caller's bytes are read
            # from memory once, not once for the copy and again for the write.
            self._raw.write(piece)
            self.size += take
            self._filled += take
            done += take
            if self._filled == _POOL.size:
                self._hand_over()
        return len(view)

    def _hand_over(self) -> None:
        """Queue the current chunk for hashing (the helper gives it back to the pool)."""
        chunk, filled = cast(bytearray, self._chunk), self._filled
        self._chunk = None
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="trainguard-sha256")
        self._hashed.append(self._hasher.submit(self._hash, chunk, filled))

    def _hash(self, chunk: bytearray, filled: int) -> None:
        try:
            self._sha.update(memoryview(chunk)[:filled])
        finally:
            _POOL.give(chunk)

    def digest(self) -> str:
        """``sha256:<hex>`` of everything written (call after :meth:`close`)."""
        return f"sha256:{self._sha.hexdigest()}"

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return cast(int, self._raw.fileno())

    def stop_hashing(self) -> None:
        """Hash what is queued, end the helper thread and give every buffer back
        (idempotent). Queued chunks are hashed, not cancelled: a cancelled one would never
        return its buffer to the pool."""
        if self._chunk is not None:
            _POOL.give(self._chunk)
            self._chunk = None
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

    def close(self) -> None:
        if not self.closed:
            if self._chunk is not None and self._filled:
                self._hand_over()
            self.stop_hashing()
            for hashed in self._hashed:
                hashed.result()  # re-raises what a hashing failed with: no digest then
            self._raw.flush()
        super().close()


class DigestingFileSystem:
    """Wraps the ``fs`` of a DCP storage writer or reader (a ``FileSystemBase``).

    Writing (``ledger`` given): every stream is hashed as written; when it is closed its name,
    size and SHA-256 go into the ledger; a rename (``.metadata.tmp`` to ``.metadata``) renames
    the entry. Reading (``expected`` given): a file is read whole, checked, and served from
    memory.

    Args:
        inner: the storage's own ``FileSystemBase``.
        ledger: where written files are recorded, or ``None`` for a reader.
        expected: file name -> what the manifest says of it, or ``None`` for a writer.

    Raises (reading, from ``create_stream``):
        ShardMissing: the file is not in storage.
        ShardCorrupt: the file is not in ``expected``, or its size or digest differ.
        ShardError: the file cannot be read.
    """

    def __init__(
        self,
        inner: FileSystemBase,
        *,
        ledger: _Ledger | None = None,
        expected: Mapping[str, StoredFile] | None = None,
    ) -> None:
        self._inner = inner
        self._ledger = ledger
        self._expected = expected
        self._kept: dict[str, bytes] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        name = os.path.basename(os.fspath(path))
        if "r" in mode:
            kept = self._kept.get(name)
            yield io.BytesIO(self.read_verified(path, name) if kept is None else kept)
            return
        if self._ledger is None:
            raise ShardError(f"{name}: this storage is open for reading only")
        with zip_crc_off(), self._inner.create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            try:
                yield cast(io.IOBase, stream)
            except BaseException:
                stream.stop_hashing()  # the write failed: no flush, just end the thread
                raise
            stream.close()
        self._ledger.record(name, stream.size, stream.digest())

    def keep(self, path: str | os.PathLike[str], name: str) -> None:
        """Verify file ``name`` now and serve its bytes from memory when DCP opens it."""
        self._kept[name] = self.read_verified(path, name)

    def read_verified(self, path: str | os.PathLike[str], name: str) -> bytes:
        """The bytes of file ``name`` at ``path``, once they match the manifest's entry
        (raises as the class says)."""
        # Not ``self._expected or {}``: the truth of a lazy mapping would read all of it.
        expected = None if self._expected is None else self._expected.get(name)
        if expected is None:
            raise ShardCorrupt(f"{path} is not among the files of the snapshot's manifest")
        try:
            with storage_errors(os.fspath(path)), self._inner.create_stream(path, "rb") as raw:
                data = cast(bytes, raw.read())
        except FileNotFoundError as exc:
            raise ShardMissing(f"{path} does not exist") from exc
        except OSError as exc:
            raise ShardError(f"{path} cannot be read: {exc}") from exc
        if len(data) != expected.size_bytes:
            raise ShardCorrupt(
                f"{path} has {len(data)} bytes, its manifest says {expected.size_bytes}"
            )
        actual = f"sha256:{hashlib.sha256(data).hexdigest()}"
        if actual != expected.digest:
            raise ShardCorrupt(f"{path} has digest {actual}, expected {expected.digest}")
        return data

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self._inner.rename(path, new_path)
        if self._ledger is not None:
            self._ledger.rename(
                os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
            )

    def __getattr__(self, name: str) -> Any:
        # concat_path, init_path, mkdir, exists, rm_file, ls: the storage's own.
        return getattr(self._inner, name)


def _writer_for(uri: str) -> Any:
    if _is_local(uri):
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        return FileSystemWriter(_local_path(uri), single_file_per_rank=True, sync_files=True)
    # DCP's own fsspec writer, the one dcp.save picks for such a checkpoint_id. Object stores
    # make an object durable when its upload completes: no fsync (DCP would fall back to a
    # machine-wide sync()).
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(uri, single_file_per_rank=True, sync_files=False)


def _reader_for(uri: str) -> Any:
    if _is_local(uri):
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        return FileSystemReader(_local_path(uri))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(uri)


@dataclass(frozen=True, slots=True)
class DcpWrite:
    """A DCP storage writer for one step's folder and what it wrote.

    Attributes:
        uri: the folder.
        writer: the ``StorageWriter`` to hand to ``dcp.save`` / ``dcp.async_save``.
        ledger: the files written through it so far.
    """

    uri: str
    writer: StorageWriter
    ledger: _Ledger

    def write_sidecar(self, rank: int, own: Mapping[str, Any]) -> None:
        """Write the agent's state of ``rank`` (``torch.save``) into the folder, digested.

        Raises:
            OSError: the storage refused the write.
        """
        import torch

        writer = cast(Any, self.writer)
        path = writer.fs.concat_path(writer.path, sidecar_name(rank))
        with writer.fs.create_stream(path, "wb") as stream:
            torch.save(dict(own), stream)
            if _is_local(self.uri):
                stream.flush()
                os.fsync(stream.fileno())

    def files(self) -> tuple[StoredFile, ...]:
        """The files written so far, in name order."""
        return self.ledger.files()


def storage_writer(uri: str) -> DcpWrite:
    """A DCP storage writer for the folder ``uri`` that records every file's digest.

    Raises:
        ImportError: ``uri`` is not ``file://`` and fsspec (or the scheme's implementation,
            e.g. s3fs for ``s3://``) is not installed.
        ValueError: fsspec knows no implementation for the scheme.
    """
    ledger = _Ledger()
    writer = _writer_for(uri)
    writer.fs = DigestingFileSystem(writer.fs, ledger=ledger)
    return DcpWrite(uri, cast("StorageWriter", writer), ledger)


def dcp_files(shards: tuple[Shard, ...]) -> tuple[str, dict[str, StoredFile]]:
    """The folder and the files (name -> entry) of a DCP snapshot's shards.

    Raises:
        ShardCorrupt: the shards are not one DCP checkpoint (a ``torch.save`` shard among them,
            folders that differ, a file listed twice, a digest that is not its file list's,
            or no ``.metadata``): a manifest the daemon would not have committed.
    """
    if not shards:
        raise ShardCorrupt("the snapshot has no shards")
    folder = shards[0].uri
    files: dict[str, StoredFile] = {}
    for shard in shards:
        if shard.files is None or shard.uri != folder:
            raise ShardCorrupt(f"rank {shard.rank}'s shard is not part of the DCP folder {folder}")
        if shard.digest != files_digest(shard.files):
            raise ShardCorrupt(f"rank {shard.rank}'s digest does not match its file list")
        for f in shard.files:
            if files.setdefault(f.name, f) is not f:
                raise ShardCorrupt(f"{f.name} is listed by two ranks")
    if METADATA not in files:
        raise ShardCorrupt(f"the DCP snapshot in {folder} lists no {METADATA}")
    return folder, files


_WRITER = re.compile(r"__(\d+)_\d+\.distcp|trainguard\.rank(\d{5})\.pt")
"""The names DCP's file-per-rank writer and the agent give a rank's files: the rank in them."""


class _SnapshotFiles(Mapping[str, StoredFile]):
    """A DCP snapshot's files by name, for :class:`DigestingFileSystem`, read from the
    snapshot's manifest as they are asked for: a name is looked up in the shard of the rank
    that writes such a name (``.metadata``: rank 0), so a rank that reads its own files reads
    one part of the manifest; any other name makes every part read.

    Raises (from lookups): as :meth:`Snapshot.shard`, and :class:`ShardCorrupt` for a shard
    that is not part of the snapshot's DCP folder or whose digest is not its file list's.
    """

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self._folder: str | None = None
        self._all: dict[str, StoredFile] | None = None

    def _files_of(self, rank: int) -> tuple[StoredFile, ...]:
        shard = self._snapshot.shard(rank)
        if shard is None:
            return ()
        if self._folder is None:
            self._folder = shard.uri
        if shard.files is None or shard.uri != self._folder:
            raise ShardCorrupt(f"rank {rank}'s shard is not part of the DCP folder {self._folder}")
        if shard.digest != files_digest(shard.files):
            raise ShardCorrupt(f"rank {rank}'s digest does not match its file list")
        return shard.files

    def __getitem__(self, name: str) -> StoredFile:
        match = _WRITER.fullmatch(name)
        rank = 0 if name == METADATA else int(match[1] or match[2]) if match else None
        if rank is not None:
            found = next((f for f in self._files_of(rank) if f.name == name), None)
            if found is not None:
                return found
            if rank >= self._snapshot.world_size:
                raise KeyError(name)  # a rank the snapshot did not have wrote nothing
        if self._all is None:
            self._all = dcp_files(self._snapshot.shards())[1]
        return self._all[name]

    def __iter__(self) -> Iterator[str]:
        if self._all is None:
            self._all = dcp_files(self._snapshot.shards())[1]
        return iter(self._all)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def load_dcp(
    snapshot: Snapshot,
    state: dict[str, Any],
    rank: int,
    *,
    process_group: ProcessGroup | None,
) -> dict[str, Any] | None:
    """Load a DCP snapshot into ``state`` in place (resharding as DCP does), verified.

    Every rank calls it together (``dcp.load`` plans collectively over ``process_group``; with
    no process group, one process loads alone). Each file is checked against its digest before
    DCP sees a byte; a failure on any rank fails the load on every rank.

    Args:
        snapshot: the snapshot; the shards' ``files`` say what the folder holds, and a rank
            reads the manifest's parts of the ranks whose files it reads.
        state: the state dict to fill, e.g. ``get_state_dict(model, optimizer)``'s, with
            tensors (DTensors) of the current mesh's shapes.
        rank: this process's rank: its agent state file is read if the snapshot has one.
        process_group: the group ``dcp.load`` synchronizes over, or ``None`` without
            ``torch.distributed``.

    Returns:
        The agent's state of ``rank`` (RNG states, cursor, step) from the snapshot, or ``None``
        when the snapshot was written by fewer ranks than ``rank + 1``.

    Raises:
        ShardCorrupt, ShardMissing: a file fails its check, or is missing (on this rank or
            another: DCP gathers the failures); nothing unverified was deserialized.
        ShardError: the verified bytes do not load into ``state`` (keys or shapes that do not
            match the checkpoint), or the agent state file does not deserialize.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    first = snapshot.shard(0)
    if first is None or first.files is None:
        raise ShardCorrupt(f"snapshot {snapshot.snapshot_id} is not a DCP checkpoint")
    folder = first.uri
    expected = _SnapshotFiles(snapshot)
    reader = _reader_for(folder)
    fs = DigestingFileSystem(reader.fs, expected=expected)
    reader.fs = fs
    # Every rank reads .metadata first, so each one fails here alike when it is damaged (DCP
    # itself would fall back to looking for a rank-local metadata file and blur the reason).
    fs.keep(reader.fs.concat_path(reader.path, METADATA), METADATA)
    try:
        dcp_load(
            state,
            storage_reader=cast("StorageReader", reader),
            process_group=process_group,
            no_dist=process_group is None,
        )
    except CheckpointException as exc:
        raise _first_failure(folder, exc) from exc
    except ShardError:
        raise
    except Exception as exc:
        raise ShardError(f"DCP snapshot {folder} verified but cannot be loaded: {exc}") from exc
    name = sidecar_name(rank)
    if name not in expected:
        return None
    data = fs.read_verified(reader.fs.concat_path(reader.path, name), name)
    return load_verified_dict(data, f"{folder}/{name}")


def _first_failure(folder: str, exc: BaseException) -> ShardError:
    """The trainguard error among the ranks' failures of a DCP load (the lowest rank's), so
    every rank reports a verification failure as such; else a :class:`ShardError`."""
    failures: Mapping[int, Any] = getattr(exc, "failures", {})
    for rank in sorted(failures):
        failure = failures[rank]
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, ShardError):
            return type(cause)(f"{cause} (found by rank {rank})")
    return ShardError(f"DCP snapshot {folder} cannot be loaded: {exc}")


def dcp_problems(shards: tuple[Shard, ...], *, verify: bool) -> list[str]:
    """What is wrong with a DCP snapshot's files in storage: the shards are not one DCP
    checkpoint, a file is missing or has another size, or (``verify``) another SHA-256.

    Every file is checked, whichever rank wrote it: on another world size any rank may read
    any file. Reads through fsspec (``file://``, ``s3://``, ...), streaming: memory stays
    small whatever the file sizes.

    Returns:
        One line per problem, naming the file; empty when all is well.
    """
    import fsspec

    try:
        folder, files = dcp_files(shards)
    except ShardError as exc:
        return [str(exc)]
    try:
        fs, root = fsspec.core.url_to_fs(folder)
    except (ImportError, ValueError) as exc:
        return [f"{folder} cannot be opened: {exc}"]
    problems: list[str] = []
    for name, entry in sorted(files.items()):
        path = f"{root.rstrip('/')}/{name}"
        where = f"{folder}/{name}"
        try:
            size = fs.size(path)
            if size != entry.size_bytes:
                problems.append(f"{where} has {size} bytes, the manifest says {entry.size_bytes}")
                continue
            if verify:
                sha = hashlib.sha256()
                with fs.open(path, "rb") as stream:
                    while chunk := stream.read(_CHUNK):
                        sha.update(chunk)
                actual = f"sha256:{sha.hexdigest()}"
                if actual != entry.digest:
                    problems.append(
                        f"{where} has digest {actual}, the manifest says {entry.digest}"
                    )
        except FileNotFoundError:
            problems.append(f"{where} is missing")
        except OSError as exc:
            problems.append(f"{where} cannot be read: {exc}")
    return problems


_CHUNK = 8 << 20
"""Bytes hashed at a time when verifying a file in storage."""
