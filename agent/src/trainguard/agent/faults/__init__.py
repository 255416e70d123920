"""Injected faults for tests and ``trainguard demo``: the ``TRAINGUARD_FAULTS`` plan
(:mod:`._plan`) and the in-worker injector that carries it out at step boundaries
(:mod:`._injector`). :func:`trainguard.agent.parse_faults` is the public entry.
"""
