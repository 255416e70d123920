"""The detectors the state machine consults (ARCHITECTURE.md section 4; thresholds and their
reasoning in ``docs/detection.md``): a rank that stops making progress or is stuck in a phase
(:mod:`._stall`, with the adaptive progress timeout of :mod:`._trend`), and numerical
divergence: NaN, loss spikes, checksum mismatches (:mod:`._divergence`). Pure, like the rest of
:mod:`trainguard.daemon.core`; they are reached through the machine, not called by the shell.
"""
