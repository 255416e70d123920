"""What a worker said last (``trainguard.agent.supervisor._stderr``): the line of its stderr an
exit report carries, picked from the kept tail."""

from __future__ import annotations

from trainguard.agent.supervisor._stderr import LAST_WORDS_CHARS, last_words

TRACEBACK = """\
{"event": "training", "step": 0}
Traceback (most recent call last):
  File "/job/train.py", line 581, in <module>
    main()
  File "/job/train.py", line 548, in main
    settings = AgentConfig.resolve()
               ^^^^^^^^^^^^^^^^^^^^^
trainguard.agent._errors.ConfigError: checksum_every must be >= 0 steps, got -1
"""


def test_after_a_traceback_the_exception_is_said() -> None:
    assert last_words(TRACEBACK) == (
        "trainguard.agent._errors.ConfigError: checksum_every must be >= 0 steps, got -1"
    )


def test_the_last_of_chained_tracebacks_is_said_with_what_follows_it() -> None:
    chained = (
        TRACEBACK.replace("trainguard.agent._errors.ConfigError", "KeyError")
        + "\nDuring handling of the above exception, another exception occurred:\n\n"
        + TRACEBACK
        + "[W socket.cpp:464] process group destroyed\n"
    )
    assert last_words(chained) == (
        "trainguard.agent._errors.ConfigError: checksum_every must be >= 0 steps, got -1 | "
        "[W socket.cpp:464] process group destroyed"
    )


def test_without_a_traceback_the_last_lines_are_said() -> None:
    assert last_words("starting\n\nerror: no GPU\n  see the log\n\nbye\n") == (
        "error: no GPU |   see the log | bye"
    )
    assert last_words("") == ""
    assert last_words("\n \n") == ""


def test_a_long_text_keeps_its_end() -> None:
    said = last_words("x" * 5000 + " the reason\n")
    assert len(said) == LAST_WORDS_CHARS
    assert said.startswith("...")
    assert said.endswith(" the reason")
