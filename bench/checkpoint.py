"""DCP checkpoints through trainguard: training-thread stall, digest overhead, S3 throughput.

Usage (from the repository root)::

    python bench/checkpoint.py [--size-mb 256] [--repeat 5] [--dir D]
                               [--s3 http://host:port --bucket B] [--torch-threads N]
                               [--skip stall|digest] [--markdown]

One process, no ``torch.distributed`` (DCP runs with ``no_dist``). The state is a dict of
float32 tensors shaped like a small decoder-only transformer and its AdamW state (parameters,
``exp_avg``, ``exp_avg_sq``, a step per parameter, the param groups), at least ``--size-mb``
MiB of tensor bytes. Every measurement writes to a fresh folder (or S3 prefix), deleted after
the round; every timing is wall time (``time.perf_counter``) and each part interleaves the
two sides it compares, round by round, swapping which goes first every other round.

1. **Stall**: ``agent.checkpoint(step, state, cursor=..., blocking=False)`` of an
   :class:`~trainguard.agent.Agent` with ``checkpoint_format="dcp"`` on an embedded (SQLite)
   bus, from the call to its return (DCP's ``async_save`` with the agent's own ``HostStager``,
   whose host buffers are kept across checkpoints: the caller pays planning and the staging
   copy), against a synchronous
   ``dcp.save`` of the same state with DCP's own ``FileSystemWriter``. The first checkpoint
   (the stager allocates its buffers) is reported apart from the steady state (2nd and later:
   the stager copies into the buffers it kept). Each async save is awaited
   (``agent.wait_checkpoints()``) before the next one; that time is reported as context.
   Target: steady-state stall <= 10% of the synchronous save.
2. **Digests**: a synchronous ``dcp.save`` through ``storage_writer(uri).writer`` (every file
   hashed as written) against DCP's plain ``FileSystemWriter``, both with fsync. Target: at
   most 15% more time. Context: the plain save with torch's zip CRC32 off too, which
   trainguard's writes skip (``torch.load`` never checks it; the SHA-256 covers every byte):
   ours over it is the cost of the SHA-256 alone. Load side, context: ``load_dcp`` (every file read whole and checked
   before DCP sees it) against ``dcp.load`` with ``FileSystemReader``, each from files
   evicted from the page cache (``posix_fadvise(DONTNEED)`` after the fsynced write), so both
   read from the disk.
3. **S3** (``--s3``; credentials from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``): write
   and read through ``storage_writer`` / ``load_dcp`` with ``s3://<bucket>/...`` URIs against
   raw fsspec (``fsspec.filesystem("s3")``: ``pipe`` then ``cat`` of the same bytes, file by
   file), same s3fs filesystem instance. The endpoint reaches both through
   ``AWS_ENDPOINT_URL``; request/response checksums are set to ``when_required`` (S3Proxy).
   Target: throughput >= 80% of raw, each way.

Ratios are medians of ours over medians of the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from rich.console import Console
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from trainguard.agent import Agent, AgentConfig, Snapshot
from trainguard.agent.checkpoint._dcp import load_dcp, storage_writer
from trainguard.agent.checkpoint._zip_crc import zip_crc_off
from trainguard.schemas import DataCursor, Manifest, Shard, StoredFile, files_digest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench._report and friends

from bench._report import Report, print_report  # noqa: E402
from bench._summary import machine_notes  # noqa: E402

MIB = 1 << 20
STALL_TARGET = 0.10  # stall / synchronous save
DIGEST_TARGET = 1.15  # digesting save / plain save
S3_TARGET = 0.80  # our throughput / raw fsspec's


# -- the state ---------------------------------------------------------------------------------


def make_state(size_mb: int, hidden: int = 512, vocab: int = 8192) -> dict[str, Any]:
    """A state dict shaped like ``get_state_dict(model, AdamW)`` of a decoder-only transformer:
    ``{"model": {fqn: param}, "optim": {"state": {fqn: {step, exp_avg, exp_avg_sq}},
    "param_groups": [...]}}``, with enough blocks for ``size_mb`` MiB of float32 tensors (a
    parameter costs 12 bytes: itself and two moments)."""
    torch.manual_seed(0)
    block = {
        "attn.qkv.weight": (3 * hidden, hidden),
        "attn.out.weight": (hidden, hidden),
        "mlp.up.weight": (4 * hidden, hidden),
        "mlp.down.weight": (hidden, 4 * hidden),
        "norm1.weight": (hidden,),
        "norm2.weight": (hidden,),
    }
    per_block = sum(math.prod(s) for s in block.values())
    fixed = {"embed.weight": (vocab, hidden), "norm.weight": (hidden,)}
    fixed_params = sum(math.prod(s) for s in fixed.values())
    need = size_mb * MIB / 12
    blocks = max(1, math.ceil((need - fixed_params) / per_block))
    shapes = dict(fixed)
    for i in range(blocks):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in block.items()})
    model = {fqn: torch.randn(shape) for fqn, shape in shapes.items()}
    optim_state = {
        fqn: {
            "step": torch.tensor(1000.0),
            "exp_avg": torch.randn_like(p) * 1e-3,
            "exp_avg_sq": torch.rand_like(p) * 1e-6,
        }
        for fqn, p in model.items()
    }
    groups = [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "amsgrad": False,
            "params": list(model),
        }
    ]
    return {"model": model, "optim": {"state": optim_state, "param_groups": groups}}


def tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a nested state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(v) for v in state)
    return 0


def zeros_like_state(state: Any) -> Any:
    """A state of the same structure with zeroed tensors (what a load fills in place)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    return state


def assert_equal(a: Any, b: Any, where: str) -> None:
    """Every tensor of ``b`` equals ``a``'s (a load check, outside the timings)."""
    if isinstance(a, torch.Tensor):
        if not torch.equal(a, b):
            raise AssertionError(f"{where}: loaded tensor differs from the saved one")
    elif isinstance(a, dict):
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")


# -- helpers -----------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def evict(folder: Path) -> None:
    """Drop the (clean, fsynced) pages of ``folder``'s files from the page cache."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def snapshot_of(uri: str, files: tuple[StoredFile, ...]) -> Snapshot:
    """The snapshot of a one-rank DCP folder, with the manifest the daemon would commit."""
    size = sum(f.size_bytes for f in files)
    shard = Shard(rank=0, uri=uri, size_bytes=size, digest=files_digest(files), files=files)
    cursor = DataCursor(data_version="bench", seed=0, epoch=0, offset=0, world_size=1)
    return Snapshot.of(
        Manifest(
            job_id="bench",
            snapshot_id="bench/g0/s1",
            generation=0,
            ts=0,
            step=1,
            world_size=1,
            shards=(shard,),
            cursor=cursor,
        )
    )


def median(values: list[float]) -> float:
    return statistics.median(values)


def load_text() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


class Table:
    """Rows of ``measurement | n | median s | min s | MB/s | vs baseline | target | verdict``."""

    header: ClassVar[list[str]] = [
        "measurement",
        "n",
        "median s",
        "min s",
        "MB/s",
        "ratio",
        "target",
        "verdict",
    ]

    def __init__(self, nbytes: int) -> None:
        self.rows: list[list[str]] = []
        self.nbytes = nbytes
        self.verdicts: list[tuple[str, str]] = []

    def section(self, title: str) -> None:
        self.rows.append([f"**{title}**"] + [""] * (len(self.header) - 1))

    def add(
        self,
        name: str,
        values: list[float],
        *,
        ratio: float | None = None,
        target: str = "",
        ok: bool | None = None,
        rate: bool = True,
    ) -> None:
        m = median(values)
        verdict = "" if ok is None else ("PASS" if ok else "MISS")
        self.rows.append(
            [
                name,
                str(len(values)),
                f"{m:.3f}",
                f"{min(values):.3f}",
                f"{self.nbytes / m / 1e6:,.0f}" if rate and m > 0 else "",
                "" if ratio is None else f"{ratio:.1%}",
                target,
                verdict,
            ]
        )
        if ok is not None:
            self.verdicts.append((f"{name}: {target}", verdict))


# -- part 1: stall -----------------------------------------------------------------------------


def measure_stall(
    state: dict[str, Any], root: Path, repeat: int, s3_base: str | None = None
) -> tuple[list[float], list[float], list[float]]:
    """Per round: the stall of ``agent.checkpoint(blocking=False)``, the synchronous
    ``dcp.save`` with DCP's own writer, and the async call to its save's end (seconds).

    Local (``s3_base`` None): the agent writes under ``root``, the baseline with
    ``FileSystemWriter``. S3: both write under ``s3_base`` (``s3://bucket/prefix``; the agent's
    ``checkpoint_uri``), the baseline with DCP's ``FsspecWriter``."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    sync_s: list[float] = []
    stall_s: list[float] = []
    total_s: list[float] = []
    tmp = root / f"agent-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    config = AgentConfig.resolve(
        env={},
        job_id="ckptbench",
        bus_url=f"sqlite://{tmp}/bus.db",
        checkpoint_dir=tmp / "ckpt",
        checkpoint_format="dcp",
        checkpoint_uri=None if s3_base is None else f"{s3_base}/agent",
        host="bench",
    )
    cursor = DataCursor(data_version="bench", seed=0, epoch=0, offset=0, world_size=1)

    def remove(uri: str) -> None:
        if s3_base is None:
            shutil.rmtree(Path(uri.removeprefix("file://")))
        else:
            import fsspec  # type: ignore[import-untyped]

            rm_prefix(fsspec.filesystem("s3"), uri.removeprefix("s3://"))

    with Agent(config) as agent:
        agent.ready(0)
        for i in range(repeat):
            plain = (root / f"sync-{i}").as_uri() if s3_base is None else f"{s3_base}/sync-{i}"

            def sync(plain: str = plain) -> None:
                writer = (
                    FileSystemWriter(plain.removeprefix("file://"))
                    if s3_base is None
                    else FsspecWriter(plain)
                )
                began = time.perf_counter()
                dcp_save(state, storage_writer=writer, no_dist=True)
                sync_s.append(time.perf_counter() - began)

            def stall(step: int = i + 1) -> None:
                began = time.perf_counter()
                future = agent.checkpoint(step, state, cursor=cursor, blocking=False)
                stall_s.append(time.perf_counter() - began)
                agent.wait_checkpoints()
                total_s.append(time.perf_counter() - began)
                remove(future.result().shard_uri)

            for side in (sync, stall) if i % 2 == 0 else (stall, sync):
                side()
            remove(plain)
    return stall_s, sync_s, total_s


def part_stall(state: dict[str, Any], root: Path, repeat: int, table: Table) -> list[str]:
    stall_s, sync_s, total_s = measure_stall(state, root, repeat)
    steady_stall, steady_sync = stall_s[1:], sync_s[1:]
    ratio = median(steady_stall) / median(steady_sync)
    first_ratio = stall_s[0] / median(sync_s)
    table.section("1. training-thread stall (async DCP save through the agent, local disk)")
    table.add("baseline: sync dcp.save, FileSystemWriter (rounds 2+)", steady_sync)
    table.add(
        "agent.checkpoint(blocking=False) stall, steady (2nd+)",
        steady_stall,
        ratio=ratio,
        target="<= 10% of sync save",
        ok=ratio <= STALL_TARGET,
        rate=False,
    )
    table.add(
        "first checkpoint stall (stager allocates)", stall_s[:1], ratio=first_ratio, rate=False
    )
    table.add("context: async call -> save done (wait_checkpoints)", total_s[1:])
    return [
        "local stall per round (s): " + ", ".join(f"{v:.3f}" for v in stall_s),
        "local sync save per round (s): " + ", ".join(f"{v:.3f}" for v in sync_s),
    ]


# -- part 2: digests ---------------------------------------------------------------------------


def part_digest(state: dict[str, Any], root: Path, repeat: int, table: Table) -> list[str]:
    ours_w: list[float] = []
    plain_w: list[float] = []
    bare_w: list[float] = []
    ours_r: list[float] = []
    plain_r: list[float] = []
    hash_s: list[float] = []
    target = zeros_like_state(state)
    for i in range(repeat):
        a, b = root / f"digest-{i}", root / f"plain-{i}"
        written: dict[str, Any] = {}

        def write_ours(a: Path = a, written: dict[str, Any] = written) -> None:
            write = storage_writer(a.as_uri())
            dcp_save(state, storage_writer=write.writer, no_dist=True)
            written["files"] = write.files()

        def write_plain(b: Path = b) -> None:
            dcp_save(state, storage_writer=FileSystemWriter(b), no_dist=True)

        def write_bare(c: Path = root / f"bare-{i}") -> None:
            with zip_crc_off():
                dcp_save(state, storage_writer=FileSystemWriter(c), no_dist=True)

        def read_ours(a: Path = a, written: dict[str, Any] = written) -> None:
            load_dcp(snapshot_of(a.as_uri(), written["files"]), target, 0, process_group=None)

        def read_plain(b: Path = b) -> None:
            dcp_load(target, storage_reader=FileSystemReader(b), no_dist=True)

        pairs: list[tuple[Callable[[], None], list[float]]] = [
            (write_ours, ours_w),
            (write_plain, plain_w),
            (write_bare, bare_w),
        ]
        for fn, out in pairs if i % 2 == 0 else pairs[::-1]:
            out.append(timed(fn)[0])
        evict(a)
        evict(b)
        reads: list[tuple[Callable[[], None], list[float]]] = [
            (read_ours, ours_r),
            (read_plain, plain_r),
        ]
        for fn, out in reads if i % 2 == 0 else reads[::-1]:
            out.append(timed(fn)[0])
        if i == 0:
            assert_equal(state, target, "load")
        # The floor of digesting: SHA-256 of the same bytes, in memory, on one thread.
        data = [p.read_bytes() for p in sorted(a.iterdir())]
        began = time.perf_counter()
        for d in data:
            hashlib.sha256(d).digest()
        hash_s.append(time.perf_counter() - began)
        del data
        shutil.rmtree(a)
        shutil.rmtree(b)
        shutil.rmtree(root / f"bare-{i}")
    ratio_w = median(ours_w) / median(plain_w)
    ratio_r = median(ours_r) / median(plain_r)
    table.section("2. digests (sync dcp.save / load, local disk, fsync)")
    table.add("baseline: dcp.save, FileSystemWriter", plain_w)
    table.add(
        "dcp.save through storage_writer (digesting)",
        ours_w,
        ratio=ratio_w,
        target="<= 115% of plain",
        ok=ratio_w <= DIGEST_TARGET,
    )
    table.add(
        "context: dcp.save, FileSystemWriter, torch's zip CRC32 off (no checksum at all)",
        bare_w,
        ratio=median(ours_w) / median(bare_w),
    )
    table.add("baseline: dcp.load, FileSystemReader (cold cache)", plain_r)
    table.add("load_dcp, verified (cold cache)", ours_r, ratio=ratio_r)
    table.add("context: hashlib.sha256 of the folder's bytes in memory", hash_s)
    return []


# -- part 3: S3 --------------------------------------------------------------------------------


@contextlib.contextmanager
def s3_environment(endpoint: str) -> Iterator[None]:
    """Point botocore (through s3fs) at ``endpoint`` for the block."""
    values = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
        "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
    }
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rm_prefix(fs: Any, prefix: str) -> None:
    """Delete the objects under ``prefix`` (``fs.rm(prefix, recursive=True)`` takes 10 s a
    call on S3Proxy 2.6.0 with s3fs 2026.9.0, however few objects there are)."""
    if found := fs.find(prefix):
        fs.rm(found)


def part_s3(
    state: dict[str, Any], root: Path, endpoint: str, bucket: str, repeat: int, table: Table
) -> list[str]:
    import fsspec
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    with s3_environment(endpoint):
        fs = fsspec.filesystem("s3")
        # CreateBucket itself: S3Proxy answers GetBucketLocation with 200 for any bucket, so
        # s3fs's exists/mkdir take every bucket for existing.
        if bucket not in {b.rstrip("/") for b in fs.ls("", refresh=True)}:
            fs.call_s3("create_bucket", Bucket=bucket)
        run = f"{bucket}/ckptbench-{uuid.uuid4().hex[:8]}"
        target = zeros_like_state(state)
        # Warm-up (connections, the bucket) and the bytes the raw side writes.
        warm = storage_writer(f"s3://{run}/warm")
        dcp_save(state, storage_writer=warm.writer, no_dist=True)
        payload = {f.name: fs.cat(f"{run}/warm/{f.name}") for f in warm.files()}
        rm_prefix(fs, f"{run}/warm")
        ours_w: list[float] = []
        raw_w: list[float] = []
        dcp_w: list[float] = []
        ours_r: list[float] = []
        raw_r: list[float] = []
        dcp_r: list[float] = []
        for i in range(repeat):
            ours_uri, raw_prefix, dcp_uri = (
                f"s3://{run}/ours-{i}",
                f"{run}/raw-{i}",
                f"s3://{run}/dcp-{i}",
            )
            written: dict[str, Any] = {}

            def write_ours(uri: str = ours_uri, written: dict[str, Any] = written) -> None:
                write = storage_writer(uri)
                dcp_save(state, storage_writer=write.writer, no_dist=True)
                written["files"] = write.files()

            def write_raw(prefix: str = raw_prefix) -> None:
                for name, data in payload.items():
                    fs.pipe(f"{prefix}/{name}", data)

            def write_dcp(uri: str = dcp_uri) -> None:
                dcp_save(state, storage_writer=FsspecWriter(uri), no_dist=True)

            def read_ours(uri: str = ours_uri, written: dict[str, Any] = written) -> None:
                load_dcp(snapshot_of(uri, written["files"]), target, 0, process_group=None)

            def read_raw(prefix: str = raw_prefix) -> None:
                for name in payload:
                    fs.cat(f"{prefix}/{name}")

            def read_dcp(uri: str = dcp_uri) -> None:
                dcp_load(target, storage_reader=FsspecReader(uri), no_dist=True)

            writes: list[tuple[Callable[[], None], list[float]]] = [
                (write_ours, ours_w),
                (write_raw, raw_w),
                (write_dcp, dcp_w),
            ]
            for fn, out in writes if i % 2 == 0 else writes[::-1]:
                out.append(timed(fn)[0])
            reads: list[tuple[Callable[[], None], list[float]]] = [
                (read_ours, ours_r),
                (read_raw, raw_r),
                (read_dcp, dcp_r),
            ]
            for fn, out in reads if i % 2 == 0 else reads[::-1]:
                out.append(timed(fn)[0])
                if i == 0:
                    assert_equal(state, target, f"S3 load ({fn.__name__})")
            for prefix in (f"{run}/ours-{i}", raw_prefix, f"{run}/dcp-{i}"):
                rm_prefix(fs, prefix)
        # Throughput ratio = time of raw / time of ours (same bytes on both sides).
        ratio_w = median(raw_w) / median(ours_w)
        ratio_r = median(raw_r) / median(ours_r)
        table.section(f"3. S3 ({endpoint}, bucket {bucket})")
        table.add("baseline: raw fsspec pipe, file by file", raw_w)
        table.add(
            "write: storage_writer(s3://...) + dcp.save",
            ours_w,
            ratio=ratio_w,
            target=">= 80% of raw throughput",
            ok=ratio_w >= S3_TARGET,
        )
        table.add(
            "context: dcp.save, DCP's FsspecWriter (no digests)",
            dcp_w,
            ratio=median(raw_w) / median(dcp_w),
        )
        table.add("baseline: raw fsspec cat, file by file", raw_r)
        table.add(
            "read: load_dcp(s3://...), verified",
            ours_r,
            ratio=ratio_r,
            target=">= 80% of raw throughput",
            ok=ratio_r >= S3_TARGET,
        )
        table.add(
            "context: dcp.load, DCP's FsspecReader (unverified)",
            dcp_r,
            ratio=median(raw_r) / median(dcp_r),
        )
        stall_s, sync_s, _ = measure_stall(state, root, repeat, f"s3://{run}")
        ratio = median(stall_s[1:]) / median(sync_s[1:])
        table.add("context: sync dcp.save, FsspecWriter to S3 (rounds 2+)", sync_s[1:])
        table.add(
            "context: agent.checkpoint(blocking=False) stall, checkpoint_uri=s3://",
            stall_s[1:],
            ratio=ratio,
            rate=False,
        )
        rm_prefix(fs, run)
    sizes = ", ".join(f"{n} {len(d):,} B" for n, d in payload.items())
    return [f"S3 objects per checkpoint: {sizes}"]


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    """Run the three parts and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256, help="MiB of tensors (>= 200)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds of each part (>= 2)")
    parser.add_argument("--dir", type=Path, default=None, help="where local folders go")
    parser.add_argument("--s3", default=None, help="S3-compatible endpoint http://host:port")
    parser.add_argument("--bucket", default="trainguard-bench")
    parser.add_argument("--skip", choices=["stall", "digest"], action="append", default=[])
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: torch's own, one per core)",
    )
    parser.add_argument("--markdown", action="store_true", help="Markdown tables")
    args = parser.parse_args()
    if args.repeat < 2:
        parser.error("--repeat must be at least 2 (the first checkpoint is not steady state)")
    console = Console()
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"load average at start: {load_text()}")
    state = make_state(args.size_mb)
    nbytes = tensor_bytes(state)
    print(f"state: {nbytes / MIB:.1f} MiB of float32 tensors, {len(state['model'])} parameters")
    table = Table(nbytes)
    notes: list[str] = []
    loads: list[str] = [f"torch intra-op threads: {torch.get_num_threads()}"]
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ckptbench-", dir=args.dir))

    def run(part: str, fn: Callable[[], list[str]]) -> None:
        began = time.perf_counter()
        notes.extend(fn())
        loads.append(f"{part}: {time.perf_counter() - began:.0f} s, load after: {load_text()}")

    try:
        if "stall" not in args.skip:
            run("part 1", lambda: part_stall(state, root, args.repeat, table))
        if "digest" not in args.skip:
            run("part 2", lambda: part_digest(state, root, args.repeat, table))
        if args.s3:
            s3 = args.s3
            run("part 3", lambda: part_s3(state, root, s3, args.bucket, args.repeat, table))
        else:
            notes.append("part 3 (S3) not run: no --s3 endpoint given")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = Report(
        tables=[
            (f"DCP checkpoints, {nbytes / MIB:.0f} MiB state", Table.header, table.rows),
            ("Targets", ["target", "verdict"], [[t, v] for t, v in table.verdicts]),
        ],
        notes=[
            *machine_notes(),
            *loads,
            "MB/s: state tensor bytes / median time (10^6 bytes); ratio: ours / baseline "
            "(times) for parts 1-2, raw time / our time (throughput) for part 3",
            *notes,
        ],
    )
    print_report(report, args.markdown, console)


if __name__ == "__main__":
    main()
