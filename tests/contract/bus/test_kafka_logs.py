"""The throttle on the Kafka client's log lines: the first of each template, then one per
window with the count dropped meanwhile; installed once per process on the ``aiokafka`` and
``kafka`` loggers; the exceptions aiokafka's orphaned tasks leave logged through it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from aiokafka.errors import ProducerFenced
from aiokafka.util import parse_kafka_version

from trainguard.agent.bus._kafka_logs import (
    WINDOW_S,
    Throttle,
    quiet_kafka_logs,
    quiet_kafka_orphans,
)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(msg: str, *args: object, name: str = "aiokafka.conn") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_the_first_line_of_a_template_passes_then_one_per_window_with_the_count() -> None:
    clock = _Clock()
    throttle = Throttle(window_s=30.0, clock=clock)
    connect = "Unable connect to node with id %s: %s"
    assert throttle.filter(_record(connect, 1, "refused"))
    # The same template with other arguments is the same message: dropped in the window.
    for second in range(1, 30):
        clock.now = 1000.0 + second
        assert not throttle.filter(_record(connect, 1, f"refused {second}"))
    # Another template, or the same text from another logger, has its own window.
    assert throttle.filter(_record("Unable to update metadata from %s", 1))
    assert throttle.filter(_record(connect, 1, "refused", name="aiokafka.client"))

    clock.now = 1030.0
    passed = _record(connect, 1, "refused again")
    assert throttle.filter(passed)
    assert passed.getMessage() == (
        "Unable connect to node with id 1: refused again "
        "[suppressed 29 similar messages in the last 30 s]"
    )
    clock.now = 1031.0
    assert not throttle.filter(_record(connect, 1, "x"))
    clock.now = 1070.0
    quiet_again = _record(connect, 1, "later")
    assert throttle.filter(quiet_again)
    assert quiet_again.getMessage().endswith("[suppressed 1 similar messages in the last 40 s]")


def test_a_line_after_a_quiet_window_carries_no_count() -> None:
    clock = _Clock()
    throttle = Throttle(window_s=5.0, clock=clock)
    assert throttle.filter(_record("Metadata update failed"))
    clock.now += 5.0
    record = _record("Metadata update failed")
    assert throttle.filter(record)
    assert record.getMessage() == "Metadata update failed"


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        Throttle(window_s=0)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name} {record.levelname} {record.getMessage()}")


@pytest.fixture
def root_handler() -> Iterator[_Collect]:
    handler = _Collect()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def test_installed_once_for_the_client_loggers_and_their_children(
    root_handler: _Collect,
) -> None:
    throttle = quiet_kafka_logs()
    assert quiet_kafka_logs() is throttle
    assert throttle.window_s == WINDOW_S
    template = "Unable to request metadata from node %s (test_kafka_logs)"
    for n in range(100):
        logging.getLogger("aiokafka.client").error(template, n)
        logging.getLogger("kafka.conn").warning(template, n)
    # Other loggers are not throttled.
    for n in range(3):
        logging.getLogger("trainguard.test").warning(template, n)
    assert root_handler.messages == [
        "aiokafka.client ERROR Unable to request metadata from node 0 (test_kafka_logs)",
        "kafka.conn WARNING Unable to request metadata from node 0 (test_kafka_logs)",
        *(
            f"trainguard.test WARNING Unable to request metadata from node {n} (test_kafka_logs)"
            for n in range(3)
        ),
    ]


def test_exceptions_aiokafka_left_unretrieved_are_warnings_through_the_throttle(
    root_handler: _Collect, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quiet_kafka_logs(), "_seen", {})  # fresh windows for this test
    loop = asyncio.new_event_loop()
    seen: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: seen.append(context))
    try:
        quiet_kafka_orphans(loop)
        quiet_kafka_orphans(loop)  # idempotent: one handler, not two in a chain
        for _ in range(50):
            loop.call_exception_handler(
                {"message": "Future exception was never retrieved", "exception": ProducerFenced()}
            )
        # A builtin exception raised in aiokafka's code (as its transaction manager's KeyError
        # after a fence).
        with pytest.raises(ValueError, match=r"9\.9") as raised:
            parse_kafka_version("9.9")
        loop.call_exception_handler(
            {"message": "Task exception was never retrieved", "exception": raised.value}
        )
        # Anything else goes to the previous handler, as before.
        other = {"message": "Future exception was never retrieved", "exception": KeyError(1)}
        loop.call_exception_handler(other)
        loop.call_exception_handler({"message": "Task was destroyed but it is pending!"})
    finally:
        loop.close()
    assert seen == [other, {"message": "Task was destroyed but it is pending!"}]
    assert root_handler.messages == [
        "aiokafka WARNING Future exception was never retrieved (an aiokafka task's, nobody "
        "awaits it): ProducerFenced('There is a newer producer using the same transactional_id "
        "ortransaction timeout occurred (check that processing time is below "
        "transaction_timeout_ms)')",
    ]
