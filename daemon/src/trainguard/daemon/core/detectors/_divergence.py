"""Divergence detectors: non-finite loss, loss spikes, parameter checksums that disagree, ranks
too far apart in step, and data versions that disagree (ARCHITECTURE.md section 4).

Onsets are bounded by steps, not times: each detector names the last step known good
(``Failure.onset_after_step``) and the restore targets a committed step at or before it. The
known-good step is the step before the latest normal loss sample (loss detectors: the loss of
step s shows the parameters after step s - 1 were sound) or the latest step at which a replica
group's checksums agreed (checksums), and otherwise the step the generation started from (the
restore target's step, or the first step reported in generation 0: the initial parameters are
taken as good).
"""

from __future__ import annotations

import math

from msgspec import structs
from rpds import HashTrieMap

from trainguard.daemon.core._decisions import Anomaly
from trainguard.daemon.core._evidence import Measures, hosts_text, number_text, ranks_text
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._recovery import Failure
from trainguard.daemon.core._state import JobState, RankState, Spike, Trend, Watch
from trainguard.daemon.core._window import robust_z_critical
from trainguard.daemon.core.detectors._trend import robust_z
from trainguard.schemas import StepRange

_PENDING_CHECKSUMS = 64
"""Incomplete ``(step, group)`` checksum sets kept; older ones are dropped (a rank that never
reports checksums must not make the state grow)."""

_HEALING = 0.5
"""A spike whose latest sample rose above the median by less than this fraction of its peak's
rise is healing (falling back towards the trend): it gets up to ``loss_spike_heal_samples``
samples to return before it is restored."""

_NS_PER_S = 1_000_000_000


def known_good(watch: Watch) -> int | None:
    """The latest step after which the parameters are known sound from the loss, else the
    generation's base step."""
    return watch.base_step if watch.sound_step is None else watch.sound_step


def nan_loss(state: JobState, rec: RankState, loss: float) -> Failure:
    """A rank reported a non-finite loss at ``rec.step``: the onset is after the last normal
    loss (and before ``rec.step``)."""
    step = rec.step if rec.step is not None else 0
    good = known_good(state.watch)
    onset = step - 1 if good is None else min(good, step - 1)
    reason = (
        f"rank {rec.rank} on host {rec.host} reported a non-finite loss ({number_text(loss)}) "
        f"at step {step} in generation {state.generation}; parameters known sound up to step "
        f"{onset}"
    )
    return Failure(
        "nan_loss",
        reason,
        (rec.rank,),
        (rec.host,),
        onset_after_step=onset,
        measures=Measures(loss=loss, step=step, sound_step=onset),
    )


def judge_loss(
    watch: Watch, trend: Trend, step: int, loss: float, generation: int, config: MachineConfig
) -> tuple[Spike | None, bool, Anomaly | None, Failure | None]:
    """Judge a finite lead-sample loss at ``step`` against the job's loss level.

    A sample whose robust z-score reaches the spike threshold (:func:`spike_threshold`) and
    which exceeds the median by at least ``loss_spike_min_rise * |median|`` opens a spike,
    judged against the median and MAD of that moment. A later sample with a z-score below ``loss_spike_return_z`` ends it as a
    *blip* (an :class:`Anomaly`). A spike that lasted ``loss_spike_persist`` samples is a
    failure unless it is *healing* (its latest sample rose above the median by less than half
    as much as its peak did); a healing spike is a failure once it lasted
    ``loss_spike_heal_samples`` samples. The failure's restore skips the batches from the step
    after the latest normal loss sample to ``step``.

    Returns:
        The spike watched afterwards (``None`` if none), whether the sample is normal (it then
        joins the loss window and ``step - 1`` becomes known sound), a blip report or ``None``,
        a failure or ``None``.
    """
    spike = watch.spike
    centre, mad = trend.loss_median, trend.loss_mad
    if centre is None or mad is None:  # too few samples yet (a spike needs them to open)
        return None, True, None, None
    # The window the median and MAD came from: no sample joins it while a spike is open, so
    # the threshold is the one the spike opened against.
    threshold = spike_threshold(trend.losses.filled, config)
    if spike is None:
        z = robust_z(loss, centre, mad)
        if z < threshold or loss - centre < config.loss_spike_min_rise * abs(centre):
            return None, True, None, None
        spike = Spike(
            onset_after_step=known_good(watch),
            skip_from=_skip_from(watch, step),
            first_step=step,
            first_loss=loss,
            z=z,
            peak_loss=loss,
            samples=1,
            median=centre,
            mad=mad,
        )
    else:
        z = robust_z(loss, spike.median, spike.mad)
        if z < config.loss_spike_return_z:
            return None, True, _blip(spike, step, loss, generation, threshold, config), None
        spike = spike._replace(samples=spike.samples + 1, peak_loss=max(spike.peak_loss, loss))
    if spike.samples < config.loss_spike_persist:
        return spike, False, None, None
    healing = loss - spike.median < _HEALING * (spike.peak_loss - spike.median)
    if healing and spike.samples < config.loss_spike_heal_samples:
        return spike, False, None, None
    failure = _spike_failure(spike, step, loss, healing, generation, threshold, config)
    return None, False, None, failure


def spike_threshold(samples: int, config: MachineConfig) -> float:
    """The robust z-score at or above which a loss sample opens a spike, against the median
    and MAD of ``samples`` normal samples: ``loss_spike_z``, raised to the score a normal
    sample reaches with probability ``loss_spike_false_alarm`` against so few samples
    (:func:`~trainguard.daemon.core._window.robust_z_critical`; ``docs/detection.md``)."""
    return max(config.loss_spike_z, robust_z_critical(samples, config.loss_spike_false_alarm))


def _skip_from(watch: Watch, step: int) -> int:
    """The first step whose batch a restore for a spike first seen at ``step`` skips: the
    step after the latest normal lead sample (its batch trained normally; ``sound_step`` is
    the step before it), else after the generation's base step, never after ``step``."""
    if watch.sound_step is not None:
        return min(watch.sound_step + 2, step)
    if watch.base_step is not None:
        return min(watch.base_step + 1, step)
    return step


def _blip(
    spike: Spike, step: int, loss: float, generation: int, threshold: float, config: MachineConfig
) -> Anomaly:
    reason = (
        f"loss blip in generation {generation}: {number_text(spike.first_loss)} at step "
        f"{spike.first_step} (robust z {number_text(spike.z)} >= {number_text(threshold)} "
        f"against median {number_text(spike.median)}) returned to the trend "
        f"({number_text(loss)} at step {step}) after {spike.samples} sample(s), before it "
        f"lasted {config.loss_spike_persist} (or {config.loss_spike_heal_samples} while "
        f"falling back) to be restored; not restored"
    )
    return Anomaly(
        kind="loss_blip",
        reason=reason,
        measures=Measures(
            first_step=spike.first_step,
            loss=spike.first_loss,
            peak_loss=spike.peak_loss,
            z=spike.z,
            z_threshold=threshold,
            median=spike.median,
            mad=spike.mad,
            samples=spike.samples,
            returned_step=step,
            returned_loss=loss,
        ),
    )


def _spike_failure(
    spike: Spike,
    step: int,
    loss: float,
    healing: bool,
    generation: int,
    threshold: float,
    config: MachineConfig,
) -> Failure:
    good = spike.onset_after_step
    skip = StepRange(from_step=min(spike.skip_from, step), to_step=step)
    how = (
        f"still falling back after {spike.samples} samples (peak {number_text(spike.peak_loss)})"
        if healing
        else f"after {spike.samples} samples"
    )
    reason = (
        f"loss spike in generation {generation}: {number_text(spike.first_loss)} at step "
        f"{spike.first_step} (robust z {number_text(spike.z)} >= {number_text(threshold)} "
        f"against median {number_text(spike.median)}, MAD {number_text(spike.mad)}), still "
        f"{number_text(loss)} at step {step} {how}; parameters known sound up to step "
        f"{'none' if good is None else good}; skipping the batches of steps "
        f"{skip.from_step}-{skip.to_step} (from the step after the last normal loss)"
    )
    return Failure(
        "loss_spike",
        reason,
        (),
        (),
        onset_after_step=good,
        skip=skip,
        measures=Measures(
            first_step=spike.first_step,
            loss=spike.first_loss,
            peak_loss=spike.peak_loss,
            last_loss=loss,
            z=spike.z,
            z_threshold=threshold,
            median=spike.median,
            mad=spike.mad,
            samples=spike.samples,
            persist=config.loss_spike_persist,
            healing=healing,
        ),
    )


def judge_checksum(
    state: JobState, rec: RankState, step: int, checksum: str, config: MachineConfig
) -> tuple[Watch, tuple[Anomaly, ...], Failure | None]:
    """Record ``rec``'s parameter checksum at ``step``; once every replica of its group reported
    that step, compare them.

    Replica group ``g`` is the ranks ``r`` with ``r % model_parallel_size == g``. Agreement
    advances the group's known-good step; disagreement is a failure whose onset is after that
    step. A strict majority names the odd ranks and reports their hosts as suspect (an
    :class:`Anomaly`); without one, every rank of the group is named and no host suspected.
    """
    watch, world_size = state.watch, state.world_size
    mp = config.model_parallel_size
    group = rec.rank % mp
    agreed = watch.agreed.get(group)
    if world_size is None or (agreed is not None and step <= agreed):
        return watch, (), None
    key = (step, group)
    reports = watch.checksums.get(key, HashTrieMap()).insert(rec.rank, checksum)
    members = len(range(group, world_size, mp))
    if len(reports) < members:
        pending = watch.checksums.insert(key, reports)
        if len(pending) > _PENDING_CHECKSUMS:
            pending = pending.remove(min(pending.keys()))
        return watch._replace(checksums=pending), (), None
    pending = HashTrieMap(
        (k, v) for k, v in watch.checksums.items() if k[1] != group or k[0] > step
    )
    by_sum: dict[str, list[int]] = {}
    for r in sorted(reports.keys()):
        by_sum.setdefault(reports[r], []).append(r)
    if len(by_sum) == 1:
        return watch._replace(checksums=pending, agreed=watch.agreed.insert(group, step)), (), None
    watch = watch._replace(checksums=pending)
    return watch, *_mismatch(state, group, step, by_sum, agreed, members)


def _mismatch(
    state: JobState,
    group: int,
    step: int,
    by_sum: dict[str, list[int]],
    agreed: int | None,
    members: int,
) -> tuple[tuple[Anomaly, ...], Failure]:
    ranked = sorted(by_sum.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    top, top_ranks = ranked[0]
    majority = len(top_ranks) * 2 > members
    odd = (
        sorted(r for s, rs in by_sum.items() if s != top for r in rs)
        if majority
        else sorted(r for rs in by_sum.values() for r in rs)
    )
    hosts = tuple(sorted({rec.host for r in odd if (rec := state.ranks.get(r)) is not None}))
    good = state.watch.base_step if agreed is None else agreed
    groups = "; ".join(f"{s[:16]}: {ranks_text(rs)}" for s, rs in ranked[:8])
    if majority:
        verdict = (
            f"majority {top[:16]} ({len(top_ranks)} of {members}); odd {ranks_text(odd)} on "
            f"{hosts_text(hosts)}"
        )
    else:
        verdict = f"no majority among {members} replicas"
    reason = (
        f"parameter checksums of replica group {group} disagree at step {step} in generation "
        f"{state.generation} ({groups}): {verdict}; last agreement at step "
        f"{'none' if good is None else good}"
    )
    anomalies: tuple[Anomaly, ...] = ()
    if majority and hosts:
        anomalies = (
            Anomaly(
                kind="suspect_host",
                reason=f"{hosts_text(hosts)} suspect: {ranks_text(odd)} computed parameters "
                f"that differ from their replicas' at step {step}",
                ranks=tuple(odd),
                hosts=hosts,
                measures=Measures(
                    step=step, group=group, majority=len(top_ranks), replicas=members
                ),
            ),
        )
    failure = Failure(
        "checksum_mismatch",
        reason,
        tuple(odd),
        hosts,
        onset_after_step=good,
        measures=Measures(
            step=step,
            group=group,
            replicas=members,
            distinct=len(by_sum),
            majority=len(top_ranks) if majority else 0,
            last_agreed_step=-1 if good is None else good,
        ),
    )
    return anomalies, failure


def judge_lag(
    state: JobState,
    rec: RankState,
    lead: int,
    late_ns: int,
    step_time_s: float | None,
    config: MachineConfig,
) -> Failure | None:
    """Judge training rank ``rec``'s heartbeat (showing ``rec.step``) against ``lead``, the
    highest training step any rank reported before it.

    The other ranks' reports are older than this one, so comparing them with it compares the
    ranks at equal times, up to this heartbeat's delivery: ``late_ns``, how much longer than
    the rank's quickest it took to reach the bus (its step may be older by that much). The
    steps the job makes in that time (``late_ns`` over the job's median step time, else over
    the heartbeat's own ``step_time_s``, seconds) are allowed on top of ``max_step_lag``; a
    late heartbeat with neither is not judged (the rank's next one is). O(1): a rank is judged
    at its own heartbeats only.

    Returns:
        A ``step_lag`` failure naming ``rec``, or ``None``.
    """
    step = rec.step if rec.step is not None else lead
    lag, limit = lead - step, config.max_step_lag
    if lag <= limit:
        return None
    pace = state.trend.step_time_median_s or step_time_s
    allowance = 0
    if late_ns > 0:
        if pace is None or pace <= 0:
            # Late before any step time is known: the steps made meanwhile have no bound, so
            # the heartbeat cannot be compared at equal times; the rank's next one is judged.
            return None
        allowance = math.ceil(late_ns / _NS_PER_S / pace)
    if lag <= limit + allowance:
        return None
    delay = number_text(late_ns / _NS_PER_S)
    late = f", plus {allowance} made while its heartbeat was {delay} s late" if allowance else ""
    reason = (
        f"rank {rec.rank} on host {rec.host} at step {step} trails the lead step {lead} by "
        f"{lag} steps (max_step_lag {limit}{late}) in generation {state.generation}"
    )
    return Failure(
        "step_lag",
        reason,
        (rec.rank,),
        (rec.host,),
        measures=Measures(
            lead_step=lead,
            step=step,
            lag=lag,
            max_step_lag=limit,
            allowance_steps=allowance,
            late_s=late_ns / _NS_PER_S,
        ),
    )


def note_data_version(
    state: JobState, rec: RankState, version: str, step: int, config: MachineConfig
) -> tuple[JobState, Anomaly | None, Failure | None, str | None]:
    """Record that rank ``rec`` reads data version ``version`` (a cursor at ``step``).

    Returns:
        The new state, and at most one of: an :class:`Anomaly` (the job moved to another data
        version and ``allow_data_version_change`` allows it), a failure (ranks disagree: the
        minority is named, the onset is before ``step``), or a refusal reason (every rank that
        reported reads another version than the job's snapshots, and that is not allowed).
    """
    old = rec.data_version
    if old == version:
        return state, None, None, None
    versions = state.watch.versions
    if old is not None:
        left = versions.get(old, 1) - 1
        versions = versions.insert(old, left) if left else versions.remove(old)
    versions = versions.insert(version, versions.get(version, 0) + 1)
    state = structs.replace(
        state,
        ranks=state.ranks.insert(rec.rank, structs.replace(rec, data_version=version)),
        watch=state.watch._replace(versions=versions),
    )
    if len(versions) > 1:
        return state, None, _version_mismatch(state, versions, step), None
    current = state.data_version
    if current is None:
        return structs.replace(state, data_version=version), None, None, None
    if version == current:
        return state, None, None, None
    if not config.allow_data_version_change:
        refusal = (
            f"rank {rec.rank} on host {rec.host} reads data version {version!r} in generation "
            f"{state.generation}, but the job's snapshots were written on {current!r}: "
            f"continuing across a data version change is refused (set "
            f"allow_data_version_change to allow it)"
        )
        return state, None, None, refusal
    anomaly = Anomaly(
        kind="data_version_changed",
        reason=f"the job moved from data version {current!r} to {version!r} in generation "
        f"{state.generation} (allowed by allow_data_version_change)",
        ranks=(rec.rank,),
        hosts=(rec.host,),
        measures=Measures(old=current, new=version, step=step),
    )
    return structs.replace(state, data_version=version), anomaly, None, None


def _version_mismatch(state: JobState, versions: HashTrieMap[str, int], step: int) -> Failure:
    counts = sorted(versions.items(), key=lambda kv: (-kv[1], kv[0]))
    common = counts[0][0]
    odd = sorted(
        (
            rec
            for rec in state.ranks.values()
            if rec.data_version is not None and rec.data_version != common
        ),
        key=lambda rec: rec.rank,
    )
    seen = ", ".join(f"{v!r} on {n} rank(s)" for v, n in counts[:8])
    reason = (
        f"ranks disagree on the data version in generation {state.generation} at step {step} "
        f"({seen}): {ranks_text(rec.rank for rec in odd)} on "
        f"{hosts_text(rec.host for rec in odd)} differ from the most common"
    )
    return Failure(
        "data_version_mismatch",
        reason,
        tuple(rec.rank for rec in odd),
        tuple(rec.host for rec in odd),
        onset_after_step=step - 1,
        measures=Measures(step=step, versions=len(versions), common=common),
    )


def is_finite(loss: float | None) -> bool:
    """Whether ``loss`` is absent or a finite number."""
    return loss is None or math.isfinite(loss)
