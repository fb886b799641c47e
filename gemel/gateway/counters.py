"""Every request the gateway turns away, counted per tenant and reason, in one place.

``app.state.gateway_counters`` (also ``app.state.gateway.counters``) is one
``GatewayCounters``. Three families, each a monotonically increasing count per label pair:

=====================  ========  =====================================================
family                 labels    values of the second label
=====================  ========  =====================================================
``auth_failures``      tenant,   ``missing_key``, ``invalid_key``, ``signature_required``,
                       reason    ``signature_malformed``, ``signature_unknown_key``,
                                 ``signature_invalid``, ``signature_expired``,
                                 ``signature_future``, ``signature_replay``,
                                 ``signature_body_mismatch``, ``not_loopback``
``rate_limited``       tenant,   ``requests`` (rpm), ``tokens`` (tpm), ``concurrent``
                       kind      (max_concurrent)
``admission_rejected`` tenant,   ``queue_full`` (the tenant's priority class queue is full)
                       reason
=====================  ========  =====================================================

``tenant`` is the tenant id when the gateway could tell who was calling (a known key id with
a wrong secret, a known ``iss`` with a bad signature), else ``"unknown"``.

Reading them: ``as_dict()`` gives ``{family: {tenant: {reason: count}}}`` (JSON-ready);
``samples()`` gives ``(metric name, labels, value)`` triples with the Prometheus names
``gemel:gateway_auth_failures_total{tenant,reason}``,
``gemel:gateway_rate_limited_total{tenant,kind}`` and
``gemel:gateway_admission_rejected_total{tenant,reason}``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator

UNKNOWN_TENANT = "unknown"

FAMILIES: dict[str, tuple[str, str]] = {
    # family -> (Prometheus metric name, name of the second label)
    "auth_failures": ("gemel:gateway_auth_failures_total", "reason"),
    "rate_limited": ("gemel:gateway_rate_limited_total", "kind"),
    "admission_rejected": ("gemel:gateway_admission_rejected_total", "reason"),
}


class GatewayCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[tuple[str, str], int]] = {f: defaultdict(int) for f in FAMILIES}

    def _inc(self, family: str, tenant: str | None, label: str) -> None:
        with self._lock:
            self._counts[family][(tenant or UNKNOWN_TENANT, label)] += 1

    def auth_failure(self, tenant: str | None, reason: str) -> None:
        self._inc("auth_failures", tenant, reason)

    def rate_limited(self, tenant: str | None, kind: str) -> None:
        self._inc("rate_limited", tenant, kind)

    def admission_rejected(self, tenant: str | None, reason: str) -> None:
        self._inc("admission_rejected", tenant, reason)

    def get(self, family: str, tenant: str, label: str) -> int:
        with self._lock:
            return self._counts[family].get((tenant, label), 0)

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{"auth_failures": {tenant: {reason: n}}, "rate_limited": {tenant: {kind: n}},
        "admission_rejected": {tenant: {reason: n}}}``; every family is present."""
        out: dict[str, dict[str, dict[str, int]]] = {f: {} for f in FAMILIES}
        with self._lock:
            for family, counts in self._counts.items():
                for (tenant, label), n in counts.items():
                    out[family].setdefault(tenant, {})[label] = n
        return out

    def samples(self) -> Iterator[tuple[str, dict[str, str], int]]:
        """``(metric name, {"tenant": t, reason-or-kind: v}, count)`` for every non-zero count."""
        with self._lock:
            snapshot = {f: dict(c) for f, c in self._counts.items()}
        for family, counts in snapshot.items():
            name, label = FAMILIES[family]
            for (tenant, value), n in sorted(counts.items()):
                yield name, {"tenant": tenant, label: value}, n
