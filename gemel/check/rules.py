"""The rule records and their one registry.

Each rule is a small frozen dataclass: what it checks, why it matters and how to fix it, and a
check function over the gathered ``Inputs``. Rules register themselves with ``@rule(...)`` in
the modules that define them; ``all_rules()`` imports those modules and returns the registry in
id order, so the documentation, the JSON output and the HTML report list the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from gemel.check.k8s import Manifests
    from gemel.check.live import Probe
    from gemel.config import GemelConfig
    from gemel.gateway.tenants import TenantsFile

Component = Literal["gateway", "network", "engine", "observability", "deployment"]
Severity = Literal["info", "low", "medium", "high"]
Status = Literal["pass", "fail", "skip"]
Needs = Literal["config", "tenants", "k8s", "url"]

COMPONENTS: tuple[Component, ...] = ("gateway", "network", "engine", "observability", "deployment")
SEVERITIES: tuple[Severity, ...] = ("info", "low", "medium", "high")
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}
STATUSES: tuple[Status, ...] = ("pass", "fail", "skip")


@dataclass(frozen=True)
class Result:
    """What a check function returns: a status and the detail naming the key or object."""

    status: Status
    detail: str


def passed(detail: str) -> Result:
    return Result("pass", detail)


def failed(detail: str) -> Result:
    return Result("fail", detail)


def skipped(reason: str) -> Result:
    return Result("skip", reason)


@dataclass
class Inputs:
    """Everything the rules read, gathered once by ``gemel.check.audit.gather``.

    A missing input is None with the reason in ``missing``, so every rule that needs it is
    skipped with that reason rather than guessing."""

    config: GemelConfig | None = None
    config_source: str = ""
    tenants: TenantsFile | None = None
    tenants_source: str = ""
    tenants_mode: int | None = None  # st_mode & 0o777 of the tenants file
    manifests: Manifests | None = None
    probe: Probe | None = None
    memory_mb: float | None = None  # memory the engines share: --memory-mb, the pod's limit, or MemTotal
    memory_source: str = ""
    now: datetime = field(default_factory=lambda: datetime.now(UTC))
    max_key_age_days: int = 365
    missing: dict[str, str] = field(default_factory=dict)  # needs -> why it is absent

    def has(self, need: Needs) -> bool:
        return {"config": self.config, "tenants": self.tenants, "k8s": self.manifests, "url": self.probe}[need] is not None


@dataclass(frozen=True)
class Rule:
    id: str
    component: Component
    severity: Severity
    needs: Needs
    title: str  # what it checks
    why: str
    fix: str
    check: Callable[[Inputs], Result] = field(repr=False, compare=False)

    def run(self, inputs: Inputs) -> Finding:
        if not inputs.has(self.needs):
            return Finding(self, "skip", inputs.missing.get(self.needs, f"no {self.needs} given"))
        try:
            result = self.check(inputs)
        except Exception as exc:  # noqa: BLE001 - a rule that cannot decide says so; the others still run
            return Finding(self, "skip", f"could not check: {type(exc).__name__}: {exc}")
        return Finding(self, result.status, result.detail)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "component": self.component, "severity": self.severity, "input": self.needs,
                "title": self.title, "why": self.why, "fix": self.fix}  # fmt: skip


@dataclass(frozen=True)
class Finding:
    rule: Rule
    status: Status
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"rule": self.rule.id, "component": self.rule.component, "severity": self.rule.severity,
                "status": self.status, "detail": self.detail}  # fmt: skip


RULES: list[Rule] = []


def rule(id: str, component: Component, severity: Severity, needs: Needs, title: str, why: str, fix: str):
    """Register the decorated function as the check of a new rule."""

    def register(fn: Callable[[Inputs], Result]) -> Callable[[Inputs], Result]:
        if any(r.id == id for r in RULES):
            raise ValueError(f"rule {id} registered twice")
        RULES.append(Rule(id, component, severity, needs, title, why, fix, fn))
        return fn

    return register


def all_rules() -> list[Rule]:
    """Every rule, in id order (the modules that define them register on import)."""
    from gemel.check import config_rules, k8s, live  # noqa: F401 - imported for their @rule registrations

    return sorted(RULES, key=lambda r: (COMPONENTS.index(r.component), r.id))
