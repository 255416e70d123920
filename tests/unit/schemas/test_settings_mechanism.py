"""trainguard.schemas.settings: one mechanism for TOML tables, overrides and the environment.

The agent's environment, the bus's ``[bus.security]`` table and the daemon's TOML file are all
checked by the same function against the same dataclass annotations, so one mistake reads the
same wherever it is made.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from trainguard.agent import AgentConfig, ConfigError
from trainguard.agent.bus import load_kafka_security
from trainguard.agent.keys import KeyStoreError, keys_dir
from trainguard.schemas.settings import build, expand_user, from_environment, parse_text


@dataclasses.dataclass(frozen=True, kw_only=True)
class Example:
    count: int = 0
    wait_s: float = 1.0
    on: bool = False
    where: Path | None = None
    mode: Literal["fast", "safe"] = "safe"
    name: str = ""


VARIABLES = {
    "count": ("EX_COUNT", "COUNT"),
    "wait_s": ("EX_WAIT",),
    "on": ("EX_ON",),
    "where": ("EX_WHERE",),
    "mode": ("EX_MODE",),
    "name": ("EX_NAME",),
}


def test_each_variable_is_parsed_by_the_annotation_of_its_field() -> None:
    env = {
        "COUNT": "7",
        "EX_WAIT": " 2.5 ",
        "EX_ON": "Yes",
        "EX_WHERE": "/tmp/x",
        "EX_MODE": "fast",
        "EX_NAME": "n",
    }
    values = from_environment(Example, env, VARIABLES)
    assert build("env", Example, values) == Example(
        count=7, wait_s=2.5, on=True, where=Path("/tmp/x"), mode="fast", name="n"
    )


def test_the_first_set_variable_wins_and_an_empty_one_is_unset() -> None:
    env = {"EX_COUNT": "", "COUNT": "3", "EX_ON": "off"}
    assert from_environment(Example, env, VARIABLES) == {"count": 3, "on": False}
    env = {"EX_COUNT": "4", "COUNT": "3"}
    assert from_environment(Example, env, VARIABLES) == {"count": 4}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"COUNT": "one"}, "COUNT (count): expected a whole number, got 'one' (a string)"),
        ({"EX_COUNT": "2.0"}, "EX_COUNT (count): expected a whole number, got '2.0' (a string)"),
        ({"EX_WAIT": "soon"}, "EX_WAIT (wait_s): expected a number of seconds, got 'soon'"),
        ({"EX_WAIT": "inf"}, "EX_WAIT (wait_s): expected a finite number of seconds, got inf"),
        ({"EX_ON": "maybe"}, "EX_ON (on): expected true or false, got 'maybe' (a string)"),
        ({"EX_MODE": "Fast"}, "EX_MODE (mode): expected one of 'fast', 'safe', got 'Fast'"),
    ],
)
def test_a_variable_that_does_not_parse_is_named_with_its_field(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        from_environment(Example, env, VARIABLES)


def test_text_and_toml_values_are_held_to_the_same_rule() -> None:
    """The same annotation refuses the same value whether it came as text or from TOML."""
    with pytest.raises(ValueError, match="expected a finite number of seconds") as text:
        parse_text("X", float, "nan", "wait_s")
    with pytest.raises(ValueError, match="expected a finite number of seconds") as table:
        build("[t]", Example, {"wait_s": float("nan")})
    assert str(text.value).split(": ", 1)[1] == str(table.value).split(": ", 1)[1]


def test_the_agent_environment_and_the_daemon_file_word_a_mistake_alike(tmp_path: Path) -> None:
    from trainguard.daemon import load_daemon_config

    with pytest.raises(ConfigError, match="expected a number of seconds, got 'abc'") as agent:
        AgentConfig.resolve(env={"TRAINGUARD_JOB": "j", "TRAINGUARD_HEARTBEAT_INTERVAL": "abc"})
    config = tmp_path / "daemon.toml"
    config.write_text('[machine]\nheartbeat_timeout_s = "abc"\n')
    with pytest.raises(ValueError, match="expected a number of seconds, got 'abc'") as daemon:
        load_daemon_config(config)
    assert "TRAINGUARD_HEARTBEAT_INTERVAL (heartbeat_interval_s)" in str(agent.value)
    assert "[machine] heartbeat_timeout_s" in str(daemon.value)


def test_the_kafka_security_table_is_checked_by_the_same_mechanism() -> None:
    with pytest.raises(ValueError, match=r"^\[bus.security\] protocol: expected a string, got 5"):
        load_kafka_security({"protocol": 5}, env={})


def test_a_home_that_names_no_user_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``~user`` of no user (pathlib raises RuntimeError) is a ValueError naming the path,
    wherever a path is expanded; ``~`` and other paths expand as pathlib does."""
    monkeypatch.setenv("HOME", "/home/someone")
    assert expand_user("~/keys") == Path("/home/someone/keys")
    assert expand_user("data/~x") == Path("data/~x")
    with pytest.raises(ValueError, match=r"^cannot expand '~no-such-user-tg/k': no home directory"):
        expand_user("~no-such-user-tg/k")
    unknown = "the path starts with a ~ or ~user whose home directory is unknown"
    with pytest.raises(KeyStoreError, match=r"^the key directory \(--keys, TRAINGUARD_KEYS\): "):
        keys_dir("~no-such-user-tg")
    # A variable is named as the variable, not as the table it could also be set in.
    variable = "TRAINGUARD_KAFKA_SASL_PASSWORD_FILE"
    with pytest.raises(ValueError, match=f"^{variable}: cannot expand"):
        load_kafka_security(None, env={variable: "~no-such-user-tg/pw"})
    # A variable that may hold a key is named, its value never quoted.
    with pytest.raises(ConfigError, match=f"^TRAINGUARD_EVENT_KEY: {unknown}$"):
        AgentConfig.resolve(
            env={"TRAINGUARD_JOB": "j", "TRAINGUARD_EVENT_KEY": "~no-such-user-tg/e"}
        )
