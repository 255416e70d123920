"""Helpers shared by the test folders (``unit``, ``contract``, ``service``, ``scenarios``,
``meta``): fresh buses of each adapter, the development Kafka broker and S3 server, simulated
jobs and traces for the pure core, a real daemon service on a bus, the daemon's side of a job's
bus, recorded jobs, export files, keys, and the wire contract's strategies and examples."""
