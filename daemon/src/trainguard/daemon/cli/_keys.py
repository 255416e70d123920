"""``trainguard keys init|job|rotate|show|retire``: the daemon's key directory
(:mod:`trainguard.daemon.admin._keys`; ``docs/security.md``).

Exit status 0 on success, 2 with a message on standard error when the directory or a key is
missing, malformed, insecure (a secret file readable by others) or the request is refused (an
existing directory to ``init``, a current key to ``retire``). Nothing prints a secret except
``show --export-agent``, which exists to hand one job's event key to its agents.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, TypeVar

import orjson
import typer

from trainguard.daemon.cli._options import given_path, os_failure

if TYPE_CHECKING:
    from trainguard.agent.keys import KeyKind
    from trainguard.daemon.admin import KeyAdmin, KeyInfo

__all__ = ["register"]

_T = TypeVar("_T")

keys_app = typer.Typer(
    help="Create, rotate, list and retire the daemon's signing, data and event keys.",
    no_args_is_help=True,
)

KeysDir = Annotated[
    Path | None,
    typer.Option(
        "--keys",
        envvar="TRAINGUARD_KEYS",
        parser=given_path,
        help="Key directory; default ~/.config/trainguard/keys.",
    ),
]


class OutputFormat(StrEnum):
    """How ``show`` prints: a table for people, JSON for tools."""

    text = "text"
    json = "json"


def register(app: typer.Typer) -> None:
    """Add the ``keys`` command group to ``app``."""
    app.add_typer(keys_app, name="keys")


def _admin(keys: Path | None) -> KeyAdmin:
    # Imported here: ``trainguard --help`` should not load cryptography.
    from trainguard.agent.keys import keys_dir
    from trainguard.daemon.admin import KeyAdmin

    with _refusals():  # a ~user that names no user
        return KeyAdmin(keys_dir(keys))


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def _refusals(directory: Path | None = None) -> Iterator[None]:
    """A key-store or file-system error inside the block ends the command with its message
    (a file-system error's in one line naming the key ``directory``) and exit status 2."""
    from trainguard.agent.keys import KeyStoreError

    try:
        yield
    except KeyStoreError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(os_failure(exc, "use the key directory", directory))


def _attempt(keys: Path | None, action: Callable[[KeyAdmin], _T]) -> _T:
    """``action`` applied to the admin of key directory ``keys`` inside :func:`_refusals`: its
    result, or the end of the command with the refusal's message and exit status 2."""
    admin = _admin(keys)
    with _refusals(admin.path):
        return action(admin)


def _created(info: KeyInfo, note: str = "") -> None:
    """Print ``created <kind> key <kid>``, `` for job <job>`` for an event key, then ``note``."""
    job_text = f" for job {info.job_id}" if info.job_id else ""
    typer.echo(f"created {info.kind} key {info.kid}{job_text}{note}")


@keys_app.command("init")
def init(
    keys: KeysDir = None,
    job: Annotated[
        list[str] | None, typer.Option(help="Also create this job's event key (repeatable).")
    ] = None,
) -> None:
    """Create the key directory with a signing key (Ed25519) and a data key (AES-256-GCM)."""
    admin = _admin(keys)
    with _refusals(admin.path):
        made = admin.init(job or ())
    for info in made:
        _created(info)
    typer.echo(f"key directory: {admin.path}")


@keys_app.command("job")
def job_key(
    job: Annotated[str, typer.Argument(metavar="JOB", help="The job whose event key to create.")],
    keys: KeysDir = None,
) -> None:
    """Create a job's event key (HMAC-SHA256), before the job starts."""
    _created(_attempt(keys, lambda admin: admin.add_job(job)))


@keys_app.command("rotate")
def rotate(
    keys: KeysDir = None,
    signing: Annotated[bool, typer.Option("--signing", help="A new signing key.")] = False,
    data: Annotated[bool, typer.Option("--data", help="A new data key.")] = False,
    job: Annotated[str | None, typer.Option(help="A new event key for this job.")] = None,
) -> None:
    """Add a new current key of one kind; the previous ones stay valid until retired."""
    chosen = [name for name, on in (("signing", signing), ("data", data), ("event", job)) if on]
    if len(chosen) != 1:
        _fail("give exactly one of --signing, --data, --job JOB")
    kind: KeyKind = "event" if job is not None else "signing" if signing else "data"
    _created(_attempt(keys, lambda admin: admin.rotate(kind, job)), " (now current)")


@keys_app.command("retire")
def retire(
    kid: Annotated[str, typer.Argument(metavar="KID", help="Key id of a key that is not current.")],
    keys: KeysDir = None,
) -> None:
    """Move a key to retired/: it no longer verifies new input."""
    info = _attempt(keys, lambda admin: admin.retire(kid))
    typer.echo(f"retired {info.kind} key {kid}")


@keys_app.command("show")
def show(
    keys: KeysDir = None,
    output_format: Annotated[
        OutputFormat, typer.Option("--format", help="text (a table) or json.")
    ] = OutputFormat.text,
    export_agent: Annotated[
        str | None,
        typer.Option(
            help="Print what this job's agents need instead (a Kubernetes Secret, JSON): the "
            "public keys and the job's event key, a SECRET."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="With --export-agent: write daemon-public-keys.pem and event-key (mode 0600) "
            "into this folder instead of printing."
        ),
    ] = None,
) -> None:
    """List every key (kind, kid, job, created, current, retired) and the public keys; no
    secret is printed, except the one --export-agent asks for."""
    if out is not None and export_agent is None:
        # Nothing else is written to a folder: the listing would print while --out was ignored.
        _fail("--out writes a job's agent files: give it with --export-agent JOB")
    admin = _admin(keys)
    with _refusals(admin.path):
        if export_agent is not None:
            _export(admin, export_agent, out)
            return
        infos = admin.all_keys()
        public = admin.store.public_keys()
    if output_format is OutputFormat.json:
        from trainguard.agent.keys import public_pem

        document = {
            "keys": [i.to_dict() for i in infos],
            "public_keys": {kid: public_pem(key) for kid, key in public.items()},
        }
        typer.echo(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
        return
    if not infos:
        typer.echo(f"no keys in {admin.path} (trainguard keys init)")
        return
    typer.echo(f"{'KIND':8} {'KID':16}  {'JOB':24} {'CREATED':20} STATUS")
    for i in infos:
        status = "retired " + (i.retired_at or "") if i.retired_at is not None else ""
        status = status or ("current" if i.current else "live")
        typer.echo(f"{i.kind:8} {i.kid:16}  {i.job_id or '-':24} {i.created_at:20} {status}")
    from trainguard.agent.keys import public_pem

    for kid, key in public.items():
        typer.echo(f"\nsigning public key {kid}:\n{public_pem(key).rstrip()}")


def _export(admin: KeyAdmin, job: str, out: Path | None) -> None:
    bundle = admin.agent_bundle(job)
    if out is None:
        manifest = bundle.secret_manifest()
        typer.echo(orjson.dumps(manifest, option=orjson.OPT_INDENT_2).decode())
        return
    public, event = bundle.write(out)
    typer.echo(
        f"wrote {public} and {event}: give the job's processes "
        f"TRAINGUARD_DAEMON_PUBLIC_KEYS={public} TRAINGUARD_EVENT_KEY={event}"
    )
