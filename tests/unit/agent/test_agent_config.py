"""AgentConfig: precedence of arguments, TRAINGUARD_* variables, launcher variables, defaults;
validation of every setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent import DEFAULT_BUS_URL, Agent, AgentConfig, ConfigError
from trainguard.agent.bus import default_bus_url, default_state_dir, parse_bus_url, sqlite_url


def test_defaults_apply_when_nothing_is_set():
    config = AgentConfig.resolve(env={}, job_id="j")
    assert (config.rank, config.world_size, config.generation) == (0, 1, 0)
    assert config.bus_url == DEFAULT_BUS_URL
    assert config.checkpoint_dir == Path("checkpoints")
    assert config.host


def test_the_default_bus_is_one_absolute_file_per_user():
    assert default_bus_url({"XDG_STATE_HOME": "/state", "HOME": "/home/u"}) == (
        "sqlite:///state/trainguard/bus.db"
    )
    # XDG_STATE_HOME unset, empty or relative (the XDG rule: ignored): under the home folder.
    for state in ({}, {"XDG_STATE_HOME": ""}, {"XDG_STATE_HOME": "rel/state"}):
        assert default_bus_url({**state, "HOME": "/home/u"}) == (
            "sqlite:///home/u/.local/state/trainguard/bus.db"
        )
    # The folder of the supervisors' node locks too (trainguard run): the same rule.
    assert default_state_dir({"XDG_STATE_HOME": "/state"}) == Path("/state/trainguard")
    assert default_state_dir({"XDG_STATE_HOME": "rel", "HOME": "/home/u"}) == Path(
        "/home/u/.local/state/trainguard"
    )
    kind, path = parse_bus_url(DEFAULT_BUS_URL)
    assert kind == "sqlite"
    assert Path(path).is_absolute()


def test_an_absolute_bus_path_takes_three_slashes_or_four():
    assert parse_bus_url("sqlite:///tmp/x/bus.db") == ("sqlite", "/tmp/x/bus.db")
    assert parse_bus_url("sqlite:////tmp/x/bus.db") == ("sqlite", "/tmp/x/bus.db")


def test_the_url_of_a_relative_bus_path_names_it_from_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    url = sqlite_url(Path("work") / "bus.db")
    assert url == f"sqlite://{tmp_path.resolve()}/work/bus.db"
    assert parse_bus_url(url) == ("sqlite", f"{tmp_path.resolve()}/work/bus.db")


def test_arguments_beat_trainguard_variables_which_beat_launcher_variables():
    env = {
        "TRAINGUARD_JOB": "from-env",
        "TRAINGUARD_RANK": "2",
        "RANK": "1",
        "WORLD_SIZE": "4",
        "TRAINGUARD_GENERATION": "3",
        "TRAINGUARD_CHECKPOINT_DIR": "/ck",
        "TRAINGUARD_HEARTBEAT_INTERVAL": "0.5",
    }
    from_env = AgentConfig.resolve(env=env)
    assert (from_env.job_id, from_env.rank, from_env.world_size) == ("from-env", 2, 4)
    assert from_env.generation == 3
    assert from_env.checkpoint_dir == Path("/ck")
    assert from_env.heartbeat_interval_s == 0.5
    assert AgentConfig.resolve(env={"RANK": "1", "WORLD_SIZE": "4"}, job_id="j").rank == 1
    argued = AgentConfig.resolve(env=env, job_id="arg", rank=3, checkpoint_dir="/other")
    assert (argued.job_id, argued.rank, argued.checkpoint_dir) == ("arg", 3, Path("/other"))


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("TRUE", True), ("off", False)])
def test_issue_4_settings_from_the_environment(raw, value):
    env = {"TRAINGUARD_CHECKSUM_EVERY": "10", "TRAINGUARD_IN_PROCESS_RESTORE": raw}
    config = AgentConfig.resolve(env=env, job_id="j")
    assert (config.checksum_every, config.in_process_restore) == (10, value)
    defaults = AgentConfig.resolve(env={}, job_id="j")
    assert (defaults.checksum_every, defaults.in_process_restore) == (50, False)


def test_issue_13_outbox_spool_and_close_settings_from_the_environment():
    env = {
        "TRAINGUARD_OUTBOX_MAX_EVENTS": "500",
        "TRAINGUARD_SPOOL_DIR": "/spool/w0",
        "TRAINGUARD_CLOSE_TIMEOUT": "2.5",
    }
    config = AgentConfig.resolve(env=env, job_id="j")
    assert (config.outbox_max_events, config.spool_dir, config.close_timeout_s) == (
        500,
        Path("/spool/w0"),
        2.5,
    )
    defaults = AgentConfig.resolve(env={}, job_id="j")
    assert (defaults.outbox_max_events, defaults.spool_dir, defaults.close_timeout_s) == (
        100_000,
        None,
        30.0,
    )


def test_none_arguments_and_empty_variables_count_as_unset():
    config = AgentConfig.resolve(env={"TRAINGUARD_JOB": "j", "RANK": ""}, job_id=None, rank=None)
    assert (config.job_id, config.rank) == ("j", 0)


@pytest.mark.parametrize(
    ("env", "settings", "match"),
    [
        ({}, {}, "job id missing"),
        (
            {"TRAINGUARD_RANK": "one"},
            {"job_id": "j"},
            r"TRAINGUARD_RANK \(rank\): expected a whole number, got 'one'",
        ),
        (
            {"WORLD_SIZE": "2.5"},
            {"job_id": "j"},
            r"WORLD_SIZE \(world_size\): expected a whole number, got '2.5'",
        ),
        ({}, {"job_id": "j", "colour": "red"}, r"agent setting: unknown key\(s\) \['colour'\]"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, {"job_id": "j"}, "rank 2 is outside world size 2"),
        ({}, {"job_id": "no spaces"}, "job_id"),
        ({}, {"job_id": "j", "host": ""}, "host"),
        ({}, {"job_id": "j", "generation": -1}, "generation"),
        ({}, {"job_id": "j", "heartbeat_interval_s": 0}, "heartbeat_interval_s"),
        ({"TRAINGUARD_RESUME_TIMEOUT": "nan"}, {"job_id": "j"}, "resume_timeout_s"),
        ({}, {"job_id": "j", "heartbeat_queue": 0}, "heartbeat_queue"),
        ({"TRAINGUARD_OUTBOX_MAX_EVENTS": "0"}, {"job_id": "j"}, "outbox_max_events must be >= 1"),
        ({"TRAINGUARD_CLOSE_TIMEOUT": "-1"}, {"job_id": "j"}, "close_timeout_s"),
        ({"TRAINGUARD_BUS": "redis://x"}, {"job_id": "j"}, "scheme must be sqlite or kafka"),
        ({"TRAINGUARD_FAULTS": "kill@step=1"}, {"job_id": "j"}, "missing rank"),
        ({"TRAINGUARD_CHECKSUM_EVERY": "-1"}, {"job_id": "j"}, "checksum_every must be >= 0"),
        (
            {"TRAINGUARD_IN_PROCESS_RESTORE": "maybe"},
            {"job_id": "j"},
            "IN_PROCESS_RESTORE.*expected true or false, got 'maybe'",
        ),
        ({}, {"job_id": "j", "hyperparameters": {"f": object()}}, "hyperparameters"),
    ],
)
def test_invalid_settings_are_refused_by_name(env, settings, match):
    with pytest.raises(ConfigError, match=match):
        AgentConfig.resolve(env=env, **settings)


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="outside world size"):
        AgentConfig(job_id="j", rank=1)


def test_agent_takes_a_config_or_settings_not_both():
    config = AgentConfig(job_id="j")
    with pytest.raises(ConfigError, match="not both"):
        Agent(config, job_id="k")


def test_a_warm_spare_that_was_not_handed_off_gets_no_settings() -> None:
    """A spare's environment names no generation: an agent made from it would train with
    stale state, so its settings are refused until ``await_handoff`` took the variable away."""
    with pytest.raises(ConfigError, match="await_handoff"):
        AgentConfig.resolve(env={"TRAINGUARD_JOB": "j", "TRAINGUARD_SPARE_FD": "5"})


def test_a_rank_torchrun_may_restart_of_its_own_under_trainguard_run_gets_no_settings() -> None:
    """torchrun with ``--max-restarts`` above 0 restarts a failed rank in the same generation,
    behind the daemon's back (``docs/launchers.md``): refused when a supervisor set the
    generation, at the first start already (a wrapper script may hide the flag from the
    supervisor, not from the worker's environment); torchrun with ``--max-restarts 0``, or
    without ``trainguard run``, is not."""
    supervised = {"TRAINGUARD_JOB": "j", "TRAINGUARD_GENERATION": "2"}
    first = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"}
    with pytest.raises(ConfigError, match=r"TORCHELASTIC_MAX_RESTARTS=3.*--max-restarts 0"):
        AgentConfig.resolve(env={**supervised, **first})
    with pytest.raises(ConfigError, match=r"TORCHELASTIC_RESTART_COUNT=1.*--max-restarts 0"):
        AgentConfig.resolve(env={**supervised, "TORCHELASTIC_RESTART_COUNT": "1"})
    none = {"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert AgentConfig.resolve(env={**supervised, **none}).generation == 2
    alone = {"TRAINGUARD_JOB": "j", **first, "TORCHELASTIC_RESTART_COUNT": "3"}
    assert AgentConfig.resolve(env=alone).generation == 0
