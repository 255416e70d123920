"""``trainguard report`` on the record of a real job: the 2-rank charlm job of the scenario
tests under a real daemon and supervisor on an embedded bus, rank 1 SIGKILLed after step 50
(checkpoints every 20 steps, so the restore goes back to step 40), then the report as text,
JSON and HTML; and the HTML rendered by headless Chromium (issue 5: "the HTML report of a demo
run renders in headless Chromium"): skipped locally when none is installed, a failure with
``CI=true`` (``.ci/run`` installs Debian's ``chromium``).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scenarios.harness import JOB, JobRun, Shape
from tests.support.buses import BusFactory
from trainguard.daemon.forensics._report_html import KIND_COLORS, PHASE_COLORS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]
KILL_STEP = 50
CHROMIUM_NAMES = ("chromium", "chromium-headless-shell", "chrome-headless-shell", "google-chrome")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BusFactory]:
    """An embedded bus holding the charlm job's record, killed once and finished."""
    folder = tmp_path_factory.mktemp("report-job")
    bus = BusFactory("sqlite", f"sqlite://{folder / 'bus.db'}", "t.")
    # The run is not compared with a reference run here (the scenario tests do that).
    run = JobRun(bus, folder, Shape(), folder / "no-reference", f"kill@step={KILL_STEP},rank=1")
    try:
        run.start_daemon()
        run.start_job(f"kill@step={KILL_STEP},rank=1")
        assert run.finish() == 0, f"the job failed {run.describe()}"
        yield bus
    finally:
        run.close()


def report(bus: BusFactory, *args: str) -> str:
    done = subprocess.run(
        [*CLI, "report", JOB, "--bus", bus.url, "--prefix", bus.prefix, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_report_shows_the_kill_and_the_steps_it_cost(recorded: BusFactory) -> None:
    doc = json.loads(report(recorded, "--format", "json"))
    assert (doc["ended"], doc["world_size"], doc["final_step"]) == ("finished", 2, 120)
    [incident] = doc["incidents"]
    assert (incident["cause"], incident["ranks"], incident["outcome"]) == ("exited", [1], "resumed")
    assert (incident["target_step"], incident["mode"]) == (40, "restart")
    # Rank 1 died right after step 50; rank 0 may have finished step 51 on its own.
    assert incident["reached_step"] in (KILL_STEP, KILL_STEP + 1)
    assert incident["recomputed_steps"] == incident["reached_step"] - 40
    assert 0 <= incident["detection_s"] < 1.0  # the supervisor's exit report
    assert incident["restore_s"] > 0
    assert incident["lost_s"] == pytest.approx(
        incident["detection_s"] + incident["restore_s"] + incident["recomputed_s"]
    )
    assert sum(doc["time_s"].values()) == pytest.approx(doc["wall_s"])
    assert 0 < doc["goodput"] < 1
    assert doc["time_s"]["restore"] == pytest.approx(incident["restore_s"])
    advice = doc["checkpoint"]
    assert (advice["failures"], advice["interval_steps"]) == (1, 20)
    assert advice["young_s"] is not None

    text = report(recorded)
    assert "exited" in text
    assert "s40" in text
    assert f"({incident['recomputed_steps']} recomputed)" in text


@pytest.fixture(scope="module")
def page(recorded: BusFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report-html") / "report.html"
    report(recorded, "--html", str(path))
    return path


def test_the_html_report_holds_the_timeline(page: Path) -> None:
    html = page.read_text()
    assert '<svg id="timeline"' in html
    assert html.count('class="span"') >= 4  # init and train, per rank and generation
    assert "i1 exited" in html
    assert "resume from step 40" in html


def chromium() -> str | None:
    """A Chromium to run headless: ``$TRAINGUARD_CHROMIUM``, else one on ``PATH``."""
    named = os.environ.get("TRAINGUARD_CHROMIUM")
    if named:
        return named
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def test_the_html_report_renders_in_headless_chromium(page: Path, tmp_path: Path) -> None:
    browser = chromium()
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no headless Chromium: .ci/run installs Debian's chromium")
        pytest.skip("no headless Chromium (apt-get install chromium)")
    # --no-sandbox: the tests may run as root, where Chromium's sandbox refuses to start. The
    # rest keeps it off the network (closed here: refused connections slow it down) and out of
    # the user's profile.
    flags = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ]
    dom = subprocess.run(
        [*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    chart = dom[dom.index('<svg id="timeline"') : dom.index("</svg>")]
    assert chart.count("<rect") >= 10, chart[:2000]
    shot = tmp_path / "report.png"
    subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1200,800", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    colors = rgb_counts(shot)
    # The bars themselves, not only the legend's 12 x 12 swatches.
    for color in (PHASE_COLORS["train"], KIND_COLORS["productive"], KIND_COLORS["restore"]):
        assert colors[rgb(color)] > 1000, f"{color} covers {colors[rgb(color)]} pixels"


def rgb(color: str) -> tuple[int, int, int]:
    """``"#1565c0"`` -> ``(21, 101, 192)``."""
    value = int(color.removeprefix("#"), 16)
    return value >> 16, (value >> 8) & 255, value & 255


def rgb_counts(path: Path) -> collections.Counter[tuple[int, int, int]]:
    """Pixels per color of an 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes),
    decoded with the standard library: chunks, zlib, and the five row filters of the PNG
    specification (W3C, "Portable Network Graphics (PNG) Specification", section 9)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, []
    header: tuple[int, ...] = ()
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    width, height, depth, color, _, _, interlace = header
    assert (depth, interlace, color in (2, 6)) == (8, 0, True), f"unexpected PNG {header}"
    bpp = 3 if color == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(b"".join(idat))
    counts: collections.Counter[tuple[int, int, int]] = collections.Counter()
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        method, row = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride if method else 0):
            left = row[i - bpp] if i >= bpp else 0
            up, corner = prev[i], prev[i - bpp] if i >= bpp else 0
            if method == 1:
                row[i] = (row[i] + left) & 255
            elif method == 2:
                row[i] = (row[i] + up) & 255
            elif method == 3:
                row[i] = (row[i] + (left + up) // 2) & 255
            elif method == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                predictor = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                row[i] = (row[i] + predictor) & 255
        counts.update(zip(row[0::bpp], row[1::bpp], row[2::bpp], strict=True))
        prev = row
    return counts
