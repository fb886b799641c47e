"""The engine replicas of one model as a Ray Serve application that something else deploys.

KubeRay's RayService owns its Serve applications (it deploys them from ``serveConfigV2`` on each
cluster it creates, and updates them in place). For gemel that application is the one
``gemel serve`` would deploy itself; ``serveConfigV2`` names it like this::

    applications:
      - name: gemel-smollm2-135m-instruct          # gemel-<model id>, the name the front end looks for
        import_path: gemel.scale.app:build
        route_prefix: null                          # reached through gemel's front end only
        args: {config: /etc/gemel/config/gemel.yaml, model: smollm2-135m-instruct}

``build`` reads the same gemel.yaml the front end reads and returns ``ReplicaPool.application()``
for the model, so the replicas' engine settings, resources, autoscaling and request router are
exactly those of ``gemel serve``; the front end, with ``scale.attach: true``, then sends to that
application instead of deploying its own. Ray Serve runs the builder as a task on any node, so
every node needs the file (deploy/k8s/ray/rayservice.yaml mounts it on all of them).
"""

from __future__ import annotations

from typing import Any

from gemel.config import load_config
from gemel.engine.supervisor import RestartPolicy
from gemel.scale.pool import ReplicaPool


def build(args: dict[str, Any]):
    """Ray Serve's application builder: ``args`` are ``config`` (a gemel.yaml path) and
    ``model`` (a catalogue id; the first model by default)."""
    if "config" not in args:
        raise ValueError("gemel.scale.app:build needs args.config, the path of the gemel.yaml the front end reads")
    config = load_config(args["config"])
    if not config.scale.enabled:
        raise ValueError(f"{args['config']}: scale has one replica; give scale.replicas above 1 or min_replicas/max_replicas")
    entries = {e.id: e for e in config.models}
    model = args.get("model") or config.models[0].id
    if model not in entries:
        raise ValueError(f"{args['config']}: no model {model!r} in the catalogue ({', '.join(entries)})")
    entry = entries[model]
    s = config.server
    pool = ReplicaPool(
        entry.id, config.engine_config(entry), config.scale, stats_interval_s=s.stats_interval_s, log_level=s.log_level,
        restart=RestartPolicy(max_restarts=s.engine_max_restarts, window_s=s.engine_restart_window_s, stall_s=s.engine_stall_s),
        ready_timeout_s=s.engine_ready_timeout_s,
    )  # fmt: skip
    return pool.application()

