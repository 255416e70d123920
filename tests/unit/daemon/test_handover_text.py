"""The line a replay's timeline shows where another daemon took a job over: it names the
settings that changed."""

from __future__ import annotations

from trainguard.daemon.cli._replay import handover_text


def test_a_handover_names_the_settings_that_changed() -> None:
    a = {"daemon_id": "a", "heartbeat_timeout_s": 10.0, "restore_timeout_s": 60.0}
    assert handover_text(a, {**a, "daemon_id": "b"}) == (
        "another daemon process took over, same settings"
    )
    assert handover_text(a, {**a, "heartbeat_timeout_s": 20.0}) == (
        "daemon_id a again, with different settings: heartbeat_timeout_s 10.0 -> 20.0"
    )
