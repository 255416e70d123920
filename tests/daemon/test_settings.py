"""The daemon's configuration file: the example lists every setting, and loads."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, KafkaSecurity
from trainguard.daemon import MachineConfig
from trainguard.daemon._settings import DaemonConfig, load_daemon_config

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "daemon.example.toml"


def test_the_example_names_every_setting() -> None:
    keys = set(re.findall(r"^#?\s*([a-z_]+)\s*=", EXAMPLE.read_text(), re.MULTILINE))
    for cls in (BusConfig, KafkaSecurity, MachineConfig, DaemonConfig):
        names = {f.name for f in fields(cls) if f.init} - {"bus", "machine", "topics", "security"}
        names -= {"create"}  # BusConfig.create is set by commands, not by a configuration file
        assert names <= keys, f"{cls.__name__}: {sorted(names - keys)} missing from {EXAMPLE}"


def test_the_example_loads_to_the_defaults() -> None:
    config = load_daemon_config(EXAMPLE)
    defaults = load_daemon_config(None)
    assert config.bus == defaults.bus
    assert config.bus.topics == DEFAULT_TOPICS
    assert config.machine == MachineConfig(daemon_id=config.machine.daemon_id)
    assert (config.poll_s, config.group) == (defaults.poll_s, "trainguard.daemon")


def test_overrides_beat_the_file_and_unknown_keys_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text('[bus]\nurl = "sqlite:a.db"\n[machine]\nheartbeat_timeout_s = 3.0\n')
    config = load_daemon_config(path, machine={"heartbeat_timeout_s": 4.0})
    assert config.bus.url == "sqlite:a.db"  # the file's URL when none is given
    assert config.machine.heartbeat_timeout_s == 4.0
    path.write_text("[machine]\nheartbeat_timeout = 3.0\n")
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        load_daemon_config(path)


def test_a_configuration_file_cannot_set_whether_the_bus_is_created(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text("[bus]\ncreate = false\n")
    with pytest.raises(ValueError, match=r"\[bus\]: unknown key\(s\) \['create'\]"):
        load_daemon_config(path)
