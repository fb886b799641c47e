"""The check's results as text, JSON and Markdown, and its exit code.

Exit code: 0 when nothing above info fails, 1 when low or medium rules fail (warnings), 2 when
a high rule fails. The JSON document (``schema: gemel-check/1``) has ``inputs``, ``rules``,
``findings``, ``summary`` and ``exit_code``; fields are only ever added to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gemel.check.rules import SEVERITIES, SEVERITY_RANK, Finding, Rule

SCHEMA = "gemel-check/1"


@dataclass
class Report:
    rules: list[Rule]
    findings: list[Finding]
    inputs: dict[str, str | None] = field(default_factory=dict)

    def failed(self, *severities: str) -> list[Finding]:
        return [f for f in self.findings if f.status == "fail" and (not severities or f.rule.severity in severities)]

    @property
    def exit_code(self) -> int:
        if self.failed("high"):
            return 2
        if self.failed("low", "medium"):
            return 1
        return 0

    def summary(self) -> dict:
        counts = {s: sum(f.status == s for f in self.findings) for s in ("pass", "fail", "skip")}
        return {"rules": len(self.findings), **counts,
                "failed_by_severity": {s: len(self.failed(s)) for s in reversed(SEVERITIES)}}  # fmt: skip

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "inputs": self.inputs, "rules": [r.as_dict() for r in self.rules],
                "findings": [f.as_dict() for f in self.findings], "summary": self.summary(), "exit_code": self.exit_code}  # fmt: skip


def to_json(report: Report) -> str:
    return json.dumps(report.as_dict(), indent=2) + "\n"


def _ordered(report: Report) -> list[Finding]:
    status_order = {"fail": 0, "skip": 1, "pass": 2}
    return sorted(report.findings, key=lambda f: (status_order[f.status], -SEVERITY_RANK[f.rule.severity], f.rule.id))


def to_text(report: Report) -> str:
    lines = ["gemel check"]
    lines += [f"  {k + ':':8} {v}" for k, v in report.inputs.items() if v]
    lines.append("")
    skips: dict[str, list[str]] = {}
    for f in _ordered(report):
        if f.status == "skip":  # one line per reason: most skips share one (an input not given)
            skips.setdefault(f.detail, []).append(f.rule.id)
            continue
        lines.append(f"{f.status.upper():4}  {f.rule.severity:6}  {f.rule.id:6}  {f.rule.component:13}  {f.rule.title}")
        lines.append(f"      {f.detail}")
        if f.status == "fail":
            lines.append(f"      fix: {f.rule.fix}")
    for reason, ids in skips.items():
        lines.append(f"SKIP  {' '.join(sorted(ids))}")
        lines.append(f"      {reason}")
    s = report.summary()
    by = ", ".join(f"{n} {sev}" for sev, n in s["failed_by_severity"].items() if n) or "none"
    lines += ["", f"{s['rules']} rules: {s['pass']} pass, {s['fail']} fail ({by}), {s['skip']} skipped; exit code {report.exit_code}"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rules_markdown(rules: list[Rule]) -> str:
    """The rule table of docs/operations.md (``gemel check --list-rules --format markdown``)."""
    lines = ["| rule | component | severity | input | checks | why | fix |", "|---|---|---|---|---|---|---|"]
    for r in rules:
        lines.append(f"| `{r.id}` | {r.component} | {r.severity} | {r.needs} | {_cell(r.title)} | {_cell(r.why)} | {_cell(r.fix)} |")
    return "\n".join(lines) + "\n"


def rules_text(rules: list[Rule]) -> str:
    return "".join(f"{r.id:6}  {r.component:13}  {r.severity:6}  {r.needs:7}  {r.title}\n" for r in rules)


def rules_json(rules: list[Rule]) -> str:
    return json.dumps({"schema": SCHEMA, "rules": [r.as_dict() for r in rules]}, indent=2) + "\n"
