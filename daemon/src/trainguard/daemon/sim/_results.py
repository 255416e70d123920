"""A simulation's results: goodput measured next to the Young-Daly model's, the daemon's lag
and cost, and every fault's way to its restore; as a dict (``--format json``) and as tables.

The model (:func:`~trainguard.daemon.forensics._young_daly.model_goodput`) is evaluated for the
simulated checkpoint cost ``C``, checkpoint interval ``tau`` (compute between checkpoints),
the mean time between failures ``M`` and the measured mean downtime ``D + R`` of the faults
(fault to resume): once with ``M`` as configured, once with ``M`` as realised (training time
divided by the faults injected), which takes out the Poisson noise of a short run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from trainguard.daemon.forensics import daly_interval_s, model_goodput, young_interval_s
from trainguard.daemon.sim._driver import Measured
from trainguard.daemon.sim._model import SimParams

__all__ = ["SimSummary", "print_summary", "summarize"]


@dataclass(frozen=True, slots=True)
class SimSummary:
    """The figures of one run (see :func:`summarize`); ``as_dict`` is the JSON output."""

    data: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """The figures as plain JSON values."""
        return self.data


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p99": at(0.99), "max": ordered[-1]}


def summarize(measured: Measured, params: SimParams, mtbf_s: float, bus: str) -> SimSummary:
    """The figures of a run: goodput and the model, lag, cost, faults.

    Args:
        measured: what the run measured.
        params: the simulated job.
        mtbf_s: the configured mean time between failures (training time), seconds.
        bus: the bus, for the record (``sqlite`` or ``kafka``).
    """
    acc = measured.model.accounting
    cost, tau = params.checkpoint_cost_s, params.interval_s
    faults = acc.faults
    downtimes = [f.downtime_s for f in faults if f.downtime_s is not None]
    downtime = statistics.fmean(downtimes) if downtimes else None
    training_s = acc.training_ms / 1000
    realised = training_s / len(faults) if faults else None
    model = model_goodput(cost, mtbf_s, downtime or 0.0, tau)
    model_realised = (
        model_goodput(cost, realised, downtime or 0.0, tau) if realised is not None else None
    )
    stats = [run.stats for run in measured.daemons if run.stats is not None]
    cpu = sum(s["cpu_s"] for s in stats)
    folded = sum(s["folded"] for s in stats)
    goodput = acc.goodput(params.step_s)
    # What the ranks sent counted one per rank: a batch as the heartbeats it carries.
    batched = measured.heartbeats - measured.batches if measured.batches else 0
    rank_events = measured.records + batched
    data: dict[str, Any] = {
        "bus": bus,
        "time": "real" if measured.realtime else "simulated",
        "ranks": params.ranks,
        "ranks_per_host": params.ranks_per_host,
        "step_s": params.step_s,
        "checkpoint_cost_s": cost,
        "checkpoint_every_steps": params.checkpoint_every,
        "interval_s": tau,
        "restart_s": params.restart_s,
        "mtbf_s": mtbf_s,
        "mtbf_realised_s": realised,
        "simulated_s": acc.wall_s(),
        "training_s": training_s,
        "wall_s": measured.wall_s,
        "speed_up": acc.wall_s() / measured.wall_s if measured.wall_s > 0 else None,
        "goodput": goodput,
        "model_goodput": model,
        "model_goodput_realised_mtbf": model_realised,
        "goodput_minus_model_pp": 100 * (goodput - model),
        "downtime_s": downtime,
        "young_interval_s": young_interval_s(cost, mtbf_s),
        "daly_interval_s": daly_interval_s(cost, mtbf_s),
        "young_interval_steps": young_interval_s(cost, mtbf_s) / params.step_s,
        "model_goodput_at_young": model_goodput(cost, mtbf_s, downtime or 0.0),
        "final_step": acc.final_step,
        "trained_steps": acc.trained_steps,
        "checkpoints": acc.checkpoints,
        "records": measured.records,
        "records_per_simulated_s": measured.records / acc.wall_s() if acc.wall_s() else None,
        "heartbeats": measured.heartbeats,
        "heartbeat_batches": measured.batches,
        "rank_events": rank_events,
        "rounds": measured.rounds,
        "lag_s": _quantiles(measured.lag_s),
        "checkpoint_lag_s": _quantiles(measured.checkpoint_lag_s),
        "restart_lag_s": _quantiles(measured.restart_lag_s),
        "daemon_cpu_s": cpu if stats else None,
        "daemon_folded": folded if stats else None,
        "daemon_cpu_us_per_record": 1e6 * cpu / folded if stats and folded else None,
        "daemon_cpu_us_per_rank_event": (
            1e6 * cpu / folded * measured.records / rank_events
            if stats and folded and rank_events
            else None
        ),
        "daemon_max_rss_mb": max(s["max_rss_bytes"] for s in stats) / 2**20 if stats else None,
        "daemon_runs": [
            {"pid": r.pid, "ready_s": r.ready_s, "stats": r.stats} for r in measured.daemons
        ],
        "commands": measured.commands,
        "commands_ignored": measured.ignored,
        "stray_restores": acc.stray_restores,
        "faults": [
            {
                "kind": f.fault.kind,
                "rank": f.fault.rank,
                "at_s": f.at_ms / 1000,
                "generation": f.generation,
                "restores": f.restores,
                "detection_s": f.detection_s,
                "downtime_s": f.downtime_s,
                "reached_step": f.reached_step,
                "target_step": f.target_step,
            }
            for f in faults
        ],
        "one_restore_per_fault": all(f.restores == 1 for f in faults)
        and acc.stray_restores == 0
        and measured.ignored.get("duplicate", 0) == 0
        and measured.ignored.get("replayed", 0) == 0,
    }
    return SimSummary(data)


def _num(value: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def print_summary(summary: SimSummary, console: Console) -> None:
    """Print ``summary`` as tables: goodput against the model, the daemon, the faults."""
    d = summary.data
    head = Table(title="goodput: measured vs the Young-Daly model", show_header=False)
    head.add_column(justify="left")
    head.add_column(justify="right")
    rows = [
        ("ranks", f"{d['ranks']:,} ({d['ranks_per_host']} per host), bus {d['bus']}"),
        (
            "simulated / wall time",
            f"{d['simulated_s']:.0f} s / {d['wall_s']:.1f} s "
            f"({d['time']} time, x{_num(d['speed_up'], '.1f')})",
        ),
        ("C (checkpoint cost)", f"{d['checkpoint_cost_s']:g} s"),
        (
            "tau (compute between checkpoints)",
            f"{d['interval_s']:g} s = {d['checkpoint_every_steps']} steps",
        ),
        (
            "M (mean time between failures)",
            f"{d['mtbf_s']:g} s configured, {_num(d['mtbf_realised_s'], '.0f')} s realised",
        ),
        ("D + R (fault to resume, mean)", _num(d["downtime_s"], ".1f", " s")),
        ("goodput measured", f"{d['goodput']:.2%}"),
        (
            "model 1 - C/tau - tau/2M - (D+R)/M",
            _model(d["model_goodput"], d["downtime_s"], d["mtbf_s"]),
        ),
        (
            "model, M as realised",
            _model(d["model_goodput_realised_mtbf"], d["downtime_s"], d["mtbf_realised_s"]),
        ),
        (
            "measured - model",
            f"{d['goodput_minus_model_pp']:+.2f} pp" if d["model_goodput"] >= 0 else "-",
        ),
        (
            "recommended interval (Young)",
            f"{d['young_interval_s']:.1f} s = {d['young_interval_steps']:.0f} steps "
            f"(Daly {d['daly_interval_s']:.1f} s); model there "
            + _model(d["model_goodput_at_young"], d["downtime_s"], d["mtbf_s"]),
        ),
    ]
    for label, value in rows:
        head.add_row(label, value)
    console.print(head)
    lag = d["lag_s"]
    daemon = Table(title="the daemon", show_header=False)
    daemon.add_column()
    daemon.add_column(justify="right")
    ready = ", ".join(_num(r["ready_s"], ".2f", " s") for r in d["daemon_runs"])
    for label, value in (
        (
            "records sent",
            f"{d['records']:,} ({_num(d['records_per_simulated_s'], ',.0f')} per simulated s)",
        ),
        (
            "lag p50 / p99 / max",
            " / ".join(_num(lag[k], ".3f", " s") for k in ("p50", "p99", "max")),
        ),
        (
            "  of rounds with a checkpoint",
            " / ".join(_num(d["checkpoint_lag_s"][k], ".3f", " s") for k in ("p50", "p99", "max")),
        ),
        (
            "  across a daemon SIGKILL (not above)",
            " / ".join(_num(d["restart_lag_s"][k], ".3f", " s") for k in ("p50", "p99", "max")),
        ),
        ("CPU per record folded", _num(d["daemon_cpu_us_per_record"], ".1f", " us")),
        (
            "CPU per rank event (a batch's heartbeats each)",
            _num(d["daemon_cpu_us_per_rank_event"], ".1f", " us"),
        ),
        ("peak RSS", _num(d["daemon_max_rss_mb"], ".0f", " MB")),
        ("ready after start", ready),
        ("commands", ", ".join(f"{k} {v}" for k, v in sorted(d["commands"].items())) or "-"),
        ("exactly one restore per fault", "yes" if d["one_restore_per_fault"] else "NO"),
    ):
        daemon.add_row(label, value)
    console.print(daemon)
    # Two-line headers without vertical rules: the nine columns fit 80 columns.
    faults = Table(title="faults", box=box.SIMPLE_HEAD)
    for column in (
        "#",
        "kind",
        "rank",
        "at\n(s)",
        "restores",
        "fault to\nrestore (s)",
        "fault to\nresume (s)",
        "step\nreached",
        "restored\nto",
    ):
        faults.add_column(column, justify="right")
    for i, f in enumerate(d["faults"], 1):
        faults.add_row(
            str(i),
            f["kind"],
            str(f["rank"]),
            f"{f['at_s']:.1f}",
            str(f["restores"]),
            _num(f["detection_s"], ".3f"),
            _num(f["downtime_s"], ".1f"),
            str(f["reached_step"]),
            "-" if f["target_step"] is None else str(f["target_step"]),
        )
    console.print(faults)


def _model(value: float | None, downtime_s: float | None, mtbf_s: float | None) -> str:
    """A model's goodput, or why it does not apply: the first-order model goes below 0 where
    ``(D+R)/M`` nears 1 (the terms it drops are no longer small)."""
    if value is None:
        return "-"
    if value >= 0 or not downtime_s or not mtbf_s:
        return f"{value:.2%}"
    return f"n/a: (D+R)/M = {downtime_s / mtbf_s:.2f}, first order fails"
