"""The daemon's configuration file: the example lists every setting, and loads."""

from __future__ import annotations

import datetime
import json
import math
import re
import tempfile
import tomllib
from dataclasses import fields
from pathlib import Path
from types import MappingProxyType, UnionType
from typing import Literal, Union, get_args, get_origin, get_type_hints

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.agent.bus import (
    DEFAULT_TOPICS,
    SECURITY_ENVIRONMENT,
    BusConfig,
    KafkaSecurity,
    TopicSpec,
)
from trainguard.daemon import MachineConfig
from trainguard.daemon.service._settings import (
    DaemonConfig,
    RetentionConfig,
    SecurityConfig,
    load_daemon_config,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "daemon.example.toml"


def test_the_example_names_every_setting() -> None:
    keys = set(re.findall(r"^#?\s*([a-z_]+)\s*=", EXAMPLE.read_text(), re.MULTILINE))
    for cls in (BusConfig, KafkaSecurity, MachineConfig, DaemonConfig, RetentionConfig):
        tables = {"bus", "machine", "topics", "security", "retention"}
        names = {f.name for f in fields(cls) if f.init} - tables
        names -= {"create"}  # BusConfig.create is set by commands, not by a configuration file
        assert names <= keys, f"{cls.__name__}: {sorted(names - keys)} missing from {EXAMPLE}"


def test_the_example_loads_to_the_defaults() -> None:
    config = load_daemon_config(EXAMPLE)
    defaults = load_daemon_config(None)
    assert config.bus == defaults.bus
    assert config.bus.topics == DEFAULT_TOPICS
    assert config.machine == MachineConfig(daemon_id=config.machine.daemon_id)
    assert config.retention == RetentionConfig() == defaults.retention
    assert (config.poll_s, config.group) == (defaults.poll_s, "trainguard.daemon")


def test_overrides_beat_the_file_and_unknown_keys_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text('[bus]\nurl = "sqlite:a.db"\n[machine]\nheartbeat_timeout_s = 6.0\n')
    config = load_daemon_config(path, machine={"heartbeat_timeout_s": 7.0})
    assert config.bus.url == "sqlite:a.db"  # the file's URL when none is given
    assert config.machine.heartbeat_timeout_s == 7.0
    path.write_text("[machine]\nheartbeat_timeout = 3.0\n")
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        load_daemon_config(path)


def test_a_configuration_file_cannot_set_whether_the_bus_is_created(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text("[bus]\ncreate = false\n")
    with pytest.raises(ValueError, match=r"\[bus\]: unknown key\(s\) \['create'\]"):
        load_daemon_config(path)


BAD_VALUES = [
    # (file text, what the message must say after the file's name)
    (
        "[machine]\nheartbeat_timeout_s = 1e308",
        "[machine] heartbeat_timeout_s must be a number of seconds > 0 and <= 1e+09, got 1e+308",
    ),
    (
        "[machine]\nheartbeat_timeout_s = nan",
        "[machine] heartbeat_timeout_s: expected a finite number of seconds, got nan (a float)",
    ),
    (
        '[service]\nmetrics_port = "abc"',
        "[service] metrics_port: expected a whole number, got 'abc' (a string)",
    ),
    (
        '[machine]\nmax_restore_attempts = "3"',
        "[machine] max_restore_attempts: expected a whole number, got '3' (a string)",
    ),
    (
        '[machine]\nheartbeat_timeout_s = "10"',
        "[machine] heartbeat_timeout_s: expected a number of seconds, got '10' (a string)",
    ),
    ("[bus]\nprefix = 5", "[bus] prefix: expected a string, got 5 (an integer)"),
    ("machine = 3", "machine: expected a table, got 3 (an integer)"),
    (
        '[machine]\nrestore_mode = "sideways"',
        "[machine] restore_mode: expected one of 'restart', 'in_process', got 'sideways'",
    ),
    (
        "[machine]\nrestore_mode = 1",
        "[machine] restore_mode: expected one of 'restart', 'in_process', got 1 (an integer)",
    ),
    (
        "[machine]\nkeep_snapshots = 2.5",
        "[machine] keep_snapshots: expected a whole number, got 2.5 (a float)",
    ),
    ("[machine]\ndaemon_id = 7", "[machine] daemon_id: expected a string, got 7 (an integer)"),
    (
        '[machine]\nallow_data_version_change = "false"',
        "[machine] allow_data_version_change: expected true or false, got 'false' (a string)",
    ),
    (
        "[machine]\nallow_data_version_change = 0",
        "[machine] allow_data_version_change: expected true or false, got 0 (an integer)",
    ),
    ("[machine]\nkeep_snapshots = true", "[machine] keep_snapshots: expected a whole number"),
    ("[machine]\nkeep_snapshots = 0", "[machine] keep_snapshots must be >= 1, got 0"),
    ("[security]\nkeys_dir = 3", "[security] keys_dir: expected a path (a string), got 3"),
    ("[security]\nrequire_auth = 1", "[security] require_auth: expected true or false, got 1"),
    ("[service]\nmetrics_port = 65536", "[service] metrics_port must be a TCP port"),
    ("[service]\npoll_s = 0", "[service] poll_s must be a finite number of seconds > 0"),
    ("[service]\ncommit_interval_s = 45", "[service] commit_interval_s must be at most 10 s"),
    (  # ticks are visible only at commits: 2 * 1 + 0.05 + 3 s apart is not below bus_gap_s 5
        "[service]\ncommit_interval_s = 3",
        "[service] 2 * pulse_s + poll_s + commit_interval_s must be below bus_gap_s (5 s)",
    ),
    ("[service]\nbus = 3", "[service]: unknown key(s) ['bus']"),
    (
        "[service]\nsnapshot_interval_records = -1",
        "[service] snapshot_interval_records must be >= 0 (0: by time only)",
    ),
    (
        "[bus]\nmax_poll_interval_s = 0",
        "[bus] max_poll_interval_s must be a number of seconds > 0",
    ),
    ("[bus]\nsend_timeout_s = -1", "[bus] send_timeout_s must be a number of seconds > 0"),
    # Values the wire cannot carry (an aiokafka traceback, exit 1, once the bus was opened):
    (
        "[bus]\nsession_timeout_s = 1e10",
        "[bus] session_timeout_s must be a number of seconds > 0 and at most 2147483",
    ),
    ("[bus]\nreplication_factor = 40000", "[bus] replication_factor must be 1..32767"),
    ("[bus]\nmax_message_bytes = 4000000000", "[bus] max_message_bytes must be 1..2147418111"),
    (
        '[[bus.topics]]\nname = "events"\npartitions = 3000000000',
        "[bus] topic 'events': partitions must be 1..2147483647",
    ),
    (
        '[bus]\nurl = "kafka://h:99999"',
        "[bus] url: bus URL 'kafka://h:99999': port 99999 of 'h:99999' is not 1..65535",
    ),
    (
        '[bus]\nurl = "kafka://h:0"',
        "[bus] url: bus URL 'kafka://h:0': port 0 of 'h:0' is not 1..65535",
    ),
    ("[bus]\nkafka_options = 3", "[bus] kafka_options: expected a table, got 3 (an integer)"),
    ("[bus]\ntopics = [1]", "[bus] topics[0]: expected a table of TopicSpec fields, got 1"),
    (
        '[[bus.topics]]\nname = "events"\npartitions = "6"',
        "[bus] topics[0] partitions: expected a whole number, got '6' (a string)",
    ),
    ('[[bus.topics]]\nnme = "events"', "[bus] topics[0]: unknown key(s) ['nme']"),
    ('[[bus.topics]]\nname = "events"\npartitions = 0', "[bus] topic 'events': partitions"),
    (
        '[[bus.topics]]\nname = "snapshots"\nsegment_ms = 0',
        "[bus] topic 'snapshots': segment_ms must be >= 1",
    ),
    ("[bus.security]\nprotocol = 3", "[bus.security] protocol: expected a string"),
    (
        '[security]\nkeys_dir = "~no-such-user-tg/keys"',
        "[security] keys_dir: cannot expand '~no-such-user-tg/keys': no home directory",
    ),
    (
        '[bus.security]\nsasl_password_file = "~no-such-user-tg/pw"',
        "[bus.security] sasl_password_file: cannot expand '~no-such-user-tg/pw'",
    ),
    (
        "[retention]\ninterval_s = 0",
        "[retention] interval_s must be a finite number of seconds > 0",
    ),
    ("[retention]\nkeep_last = 0", "[retention] keep_last must be >= 1, not 0"),
    ('[retention]\nenabled = "yes"', "[retention] enabled: expected true or false, got 'yes'"),
    ("[retention]\nkeep = 3", "[retention]: unknown key(s) ['keep']"),
    ("[machine]\nheartbeat_timeout_s = ", "not valid TOML: Invalid value (at line 2, column 23)"),
]


@pytest.mark.parametrize(("text", "message"), BAD_VALUES)
def test_a_value_of_the_wrong_type_or_range_is_an_error_naming_file_table_and_key(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "d.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: {message}")):
        load_daemon_config(path)


def test_values_are_converted_to_the_fields_types(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text(
        "[machine]\nheartbeat_timeout_s = 12\n[security]\nkeys_dir = '~/k'\n"
        "[bus]\nkafka_options = {linger_ms = 5}\n[[bus.topics]]\nname = 'events'\n"
    )
    config = load_daemon_config(path)
    assert config.machine.heartbeat_timeout_s == 12.0
    assert type(config.machine.heartbeat_timeout_s) is float
    assert config.security.keys_dir == Path("~/k").expanduser()
    assert config.bus.topics == (TopicSpec("events"),)
    assert isinstance(config.bus.kafka_options, MappingProxyType)
    assert dict(config.bus.kafka_options) == {"linger_ms": 5}


def _accepted(hint: object) -> tuple[type, ...]:
    """The types of TOML scalars a field of annotation ``hint`` takes (the test's oracle)."""
    args = (
        [a for a in get_args(hint) if a is not type(None)]
        if get_origin(hint)
        in (
            Union,
            UnionType,
        )
        else [hint]
    )
    (inner,) = args
    if inner is float:
        return (int, float)
    if inner is int:
        return (int,)
    if inner is bool:
        return (bool,)
    if inner in (str, Path) or get_origin(inner) is Literal:
        return (str,)
    return ()  # tables and arrays of tables: no scalar fits


def _keys(cls: type, skip: set[str]) -> list[tuple[str, tuple[type, ...]]]:
    hints = get_type_hints(cls)
    return [
        (f.name, _accepted(hints[f.name])) for f in fields(cls) if f.init and f.name not in skip
    ]


KEYS = [
    *(("bus", k, t) for k, t in _keys(BusConfig, {"create", "security"})),
    *(("bus.security", k, (str,)) for k in SECURITY_ENVIRONMENT),
    *(("machine", k, t) for k, t in _keys(MachineConfig, set())),
    *(("service", k, t) for k, t in _keys(DaemonConfig, {"bus", "machine", "security"})),
    *(("security", k, t) for k, t in _keys(SecurityConfig, set())),
]

_TEXT = st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=8)
SCALARS = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    _TEXT,
    st.datetimes(),
    st.dates(),
)


def _toml(value: object) -> str:
    """``value`` written as a TOML scalar."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else {math.inf: "inf", -math.inf: "-inf"}.get(value, repr(value))
        )
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, datetime.date):
        return value.isoformat()
    return str(value)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(KEYS), value=SCALARS)
def test_any_scalar_gives_a_config_or_a_value_error_and_wrong_types_an_error(
    key: tuple[str, str, tuple[type, ...]], value: object
) -> None:
    table, name, accepted = key
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "d.toml"
        path.write_text(f"[{table}]\n{name} = {_toml(value)}\n")
        assert tomllib.loads(path.read_text())  # the test writes valid TOML
        try:
            load_daemon_config(path, env={})
        except ValueError as exc:
            error: str | None = str(exc)
        else:
            error = None
    if error is None:
        assert type(value) in accepted, f"[{table}] {name} = {value!r} was taken"
    else:
        assert error.startswith(f"{path}: ")
