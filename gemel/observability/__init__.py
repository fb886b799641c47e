"""Metrics (Prometheus), tracing (OpenTelemetry), the live dashboard and the stats log.

``stats`` is plain data the engine front end fills in; ``metrics``, ``tracing`` and
``dashboard`` turn it into ``/metrics``, spans and ``/dashboard``; ``setup`` wires them into
the app. Import the submodules directly: this package imports nothing heavy.
"""
