"""The data position bound to every checkpoint: the world-size independent cursor and its
arithmetic (:mod:`._cursor`), the resumable distributed sampler built on it (:mod:`._sampler`),
and the dataset version (:mod:`._dataset_version`). Their public names are exported by
:mod:`trainguard.agent`.
"""
