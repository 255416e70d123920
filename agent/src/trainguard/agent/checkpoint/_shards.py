"""Checkpoint shards on disk: durable atomic writes with a digest, verified safe loads.

A shard is one rank's part of a training snapshot, serialized with ``torch.save``. Writing
follows the usual crash-safe recipe (ARCHITECTURE.md section 5): write to a temporary name in
the target folder, ``fsync`` the file, ``rename`` it into place, ``fsync`` the folder; the
SHA-256 digest is computed from the bytes as they are written, so a shard is never read back to
be hashed. Loading reads the file once into memory, checks the digest of those bytes, and only
then deserializes *the same bytes* with ``torch.load(weights_only=True)``, which refuses
arbitrary pickled objects (PyTorch serialization docs, "weights_only"); a file swapped between
the check and the load cannot slip through.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import random
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast
from urllib.parse import unquote, urlsplit

from trainguard.agent._errors import ShardCorrupt, ShardError, ShardMissing
from trainguard.agent.checkpoint._durable import sync_folder
from trainguard.agent.checkpoint._zip_crc import zip_crc_off

__all__ = [
    "HostStager",
    "WrittenShard",
    "capture_rng",
    "load_shard",
    "load_verified_dict",
    "restore_rng",
    "shard_path",
    "uri_to_path",
    "write_shard",
]


@dataclass(frozen=True, slots=True)
class WrittenShard:
    """A shard that is durably on disk.

    Attributes:
        uri: ``file://`` URI of the shard (absolute).
        size_bytes: its size in bytes.
        digest: ``sha256:<64 lowercase hex>`` of its bytes.
    """

    uri: str
    size_bytes: int
    digest: str


class _HashingWriter:
    """File-like sink for ``torch.save`` that hashes and counts what passes through."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self._raw.write(data)

    def flush(self) -> None:
        self._raw.flush()


def shard_path(root: Path, job_id: str, generation: int, step: int, rank: int) -> Path:
    """Where rank ``rank``'s shard of ``step`` written in ``generation`` lives under ``root``:
    ``<root>/<job_id>/g<generation:06>/s<step:010>/rank<rank:05>.pt``.

    Generations get their own folders, so a step written again after a restore never replaces
    the committed shard of an earlier generation.
    """
    return root / job_id / f"g{generation:06d}" / f"s{step:010d}" / f"rank{rank:05d}.pt"


def write_shard(path: Path, state: Mapping[str, Any]) -> WrittenShard:
    """Serialize ``state`` to ``path`` atomically and durably; return its URI, size and digest.

    ``path``'s folder is created when missing; an existing file at ``path`` is replaced.

    Raises:
        OSError: the file cannot be written (disk full, permissions); then nothing is left
            behind: ``path`` keeps its previous content (or stays absent) and the temporary
            file is removed.
        pickle.PicklingError, TypeError, RuntimeError: ``torch.save`` cannot serialize
            ``state``; same clean-up.
        ShardError: ``state`` holds objects a restore could not load (``weights_only``);
            same clean-up.
    """
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with zip_crc_off(), os.fdopen(fd, "wb") as raw:
            sink = _HashingWriter(raw)
            # torch.save only calls write() and flush() on a file-like object.
            torch.save(dict(state), cast(IO[bytes], sink))
            raw.flush()
            os.fsync(raw.fileno())
        _check_loadable(tmp_name)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    sync_folder(path.parent)
    return WrittenShard(path.resolve().as_uri(), sink.size, f"sha256:{sink.sha.hexdigest()}")


def _check_loadable(written: str) -> None:
    """Raise :class:`ShardError` when the shard at ``written`` holds objects a restore's
    ``torch.load(weights_only=True)`` refuses (numpy arrays, user classes, namedtuples, ...),
    so a job learns at its first checkpoint, not at its first restore, that its snapshots
    cannot be loaded. A static scan of the shard's pickle (``data.pkl`` only, no tensor data):
    ``torch.serialization.get_unsafe_globals_in_checkpoint``, which counts what
    ``add_safe_globals`` allowed."""
    import torch

    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(written)
    if unsafe:
        raise ShardError(
            "the state holds objects a restore cannot load (torch.load with weights_only=True "
            f"refuses {', '.join(sorted(unsafe))}): store tensors, numbers, strings, lists and "
            "dicts, or allow the classes with torch.serialization.add_safe_globals"
        )


def uri_to_path(uri: str) -> Path:
    """Local path of a ``file://`` shard URI.

    Raises:
        ShardError: the URI has another scheme (only local and shared file systems are
            supported).
    """
    parts = urlsplit(uri)
    if parts.scheme != "file":
        raise ShardError(f"shard URI {uri!r}: only file:// URIs are supported")
    return Path(unquote(parts.path))


def load_shard(uri: str, digest: str) -> dict[str, Any]:
    """Verify the shard at ``uri`` against ``digest``, then deserialize it safely.

    The file is read into memory once (so loading needs the shard's size in free memory, on
    top of the tensors it holds); the digest is checked before ``torch.load`` sees a byte.

    Args:
        uri: ``file://`` URI of the shard.
        digest: the expected ``sha256:<64 hex>``.

    Raises:
        ShardMissing: no file at ``uri``.
        ShardCorrupt: the bytes do not hash to ``digest`` (damaged or tampered shard).
        ShardError: ``uri`` is not a ``file://`` URI, the file cannot be read, or the verified
            bytes do not deserialize (e.g. they hold objects ``weights_only`` refuses).
    """

    path = uri_to_path(uri)
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise ShardMissing(f"shard {uri} does not exist") from exc
    except OSError as exc:
        raise ShardError(f"shard {uri} cannot be read: {exc}") from exc
    actual = f"sha256:{hashlib.sha256(data).hexdigest()}"
    if actual != digest:
        raise ShardCorrupt(f"shard {uri} has digest {actual}, expected {digest}")
    return load_verified_dict(data, f"shard {uri}")


def load_verified_dict(data: bytes, what: str) -> dict[str, Any]:
    """Deserialize bytes already checked against their digest: ``torch.load`` with
    ``weights_only=True`` (refuses arbitrary pickled objects), tensors on the CPU.

    Args:
        data: the verified bytes.
        what: names them in errors (``"shard file:///..."``).

    Raises:
        ShardError: they do not deserialize, or hold something other than a dict.
    """
    import torch

    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ShardError(f"{what} verified but cannot be loaded: {exc}") from exc
    if not isinstance(state, dict):
        raise ShardError(f"{what} holds a {type(state).__name__}, not a dict")
    return state


class HostStager:
    """Copies a checkpoint's state to host memory for a background write (async saves, both
    formats; for DCP it is the ``async_stager`` of ``dcp.async_save``).

    The buffers are kept and reused by the next checkpoint whose tensors have the same shapes
    and dtypes (the usual case: the same model and optimizer every time), so later copies
    allocate nothing and touch no fresh pages; all copies go through one
    ``torch._foreach_copy_`` call, which releases the GIL once rather than once per tensor.
    That is the whole training-thread stall of an async save, so it is kept to the copy:
    DCP's own ``DefaultStager`` rebuilds the state by deep copy around the same copies and
    takes about half as long again (``bench/checkpoint.py``, part 1). Buffers are pinned when
    CUDA is present (faster device-to-host copies).

    What a staged copy holds: dense tensors (and parameters) as buffers; a ``DTensor`` (FSDP2,
    tensor parallel) as a ``DTensor`` of the same mesh, placements, shape and stride whose
    local tensor is a buffer (no communication); sparse, quantized or nested tensors and any
    other tensor subclass cloned; any leaf that is not an immutable scalar (``None``,
    ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``torch.dtype``,
    ``torch.device``) deep-copied; dicts, lists and tuples (namedtuples too) rebuilt, mappings
    as ``dict``, parameters as plain tensors. So once :meth:`stage` returns, the caller may
    change anything in its state.

    Reusing buffers is safe because the agent stages a checkpoint only after the previous
    write finished. Not thread-safe.
    """

    # DCP's AsyncStager protocol: stage() is synchronous, there is nothing to wait for later.
    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: list[Any] = []

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` (nested dicts/lists/tuples) whose tensors live in this
        stager's host buffers (the class docstring says what is copied how)."""
        import torch

        sources: list[torch.Tensor] = []
        rebuilt = _rebuild(state, sources)
        buffers = self._buffers
        if len(buffers) != len(sources) or any(
            b.shape != t.shape or b.dtype != t.dtype for b, t in zip(buffers, sources, strict=True)
        ):
            pin = torch.cuda.is_available()
            buffers = self._buffers = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in sources
            ]
        if sources:
            with torch.no_grad():
                torch._foreach_copy_(buffers, [t.detach() for t in sources])
        return _fill(rebuilt, iter(buffers))

    def synchronize_staging(self) -> None:
        """DCP's AsyncStager protocol: nothing to wait for (:meth:`stage` copies at once)."""

    def close(self) -> None:
        """Drop the buffers (the next :meth:`stage` allocates again)."""
        self._buffers = []


_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes)


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where a staged tensor goes in a rebuilt container; ``dtensor``: the ``DTensor`` whose
    local tensor it is (its mesh, placements, shape and stride are reused)."""

    dtensor: Any = None


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _rebuild(state: Any, tensors: list[Any]) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        if type(state) in (torch.Tensor, torch.nn.Parameter) and _plain_layout(state):
            tensors.append(state)
            return _Slot()
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(state, dtensor):
            tensors.append(cast(Any, state).to_local())
            return _Slot(state)
        return state.detach().clone()
    if isinstance(state, Mapping):
        return {key: _rebuild(value, tensors) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return _same_sequence(state, [_rebuild(value, tensors) for value in state])
    if isinstance(state, (*_IMMUTABLE, torch.dtype, torch.device)):
        return state
    return copy.deepcopy(state)


def _fill(rebuilt: Any, buffers: Any) -> Any:
    if isinstance(rebuilt, _Slot):
        buffer = next(buffers)
        if rebuilt.dtensor is None:
            return buffer
        d = rebuilt.dtensor
        return type(d).from_local(
            buffer, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
        )
    if isinstance(rebuilt, dict):
        return {key: _fill(value, buffers) for key, value in rebuilt.items()}
    if isinstance(rebuilt, list | tuple):
        return _same_sequence(rebuilt, [_fill(value, buffers) for value in rebuilt])
    return rebuilt


def _plain_layout(tensor: Any) -> bool:
    """A dense tensor a host buffer of its shape and dtype can hold (not sparse, quantized or
    nested: those are cloned)."""
    import torch

    return bool(tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_nested)


def _same_sequence(like: Any, items: list[Any]) -> Any:
    """``items`` in a sequence of ``like``'s type: a namedtuple takes them as arguments, a
    list, tuple or ``torch.return_types`` result as one iterable."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    return type(like)(items)


def capture_rng() -> dict[str, Any]:
    """The RNG states a bitwise-exact resume needs: torch (CPU), Python ``random``, NumPy.

    Stored in forms ``torch.load(weights_only=True)`` accepts (tensors, tuples, ints, floats,
    strings). NumPy's is left out when NumPy is not installed. CUDA generators are not
    captured.
    """
    import torch

    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
    except ImportError:
        return rng
    # legacy=True returns the MT19937 tuple (name, keys, pos, has_gauss, cached_gaussian).
    name, keys, pos, has_gauss, cached = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    rng["numpy"] = (
        str(name),
        torch.from_numpy(keys.copy()),
        int(pos),
        int(has_gauss),
        float(cached),
    )
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Set the RNG states captured by :func:`capture_rng`."""
    import torch

    torch.set_rng_state(rng["torch"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        import numpy as np

        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
