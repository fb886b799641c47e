"""The HTML report: one self-contained page, readable offline and safe to attach to a CI run.

Plain HTML and CSS generated here, with a few lines of inline script for the filters; a
Content-Security-Policy of ``default-src 'none'`` guarantees that the page loads nothing.
The risk heatmap is components x severities: each cell shows how many rules failed there
and is coloured by its worst status (fail, then skip, then pass); hovering or focusing a
cell lists its rules below the map, clicking it filters the table to them.
"""

from __future__ import annotations

import json
from html import escape

from gemel.check.report import Report
from gemel.check.rules import COMPONENTS, SEVERITIES, Finding

HEAT_SEVERITIES = tuple(reversed(SEVERITIES))  # high first
STATUS_ORDER = ("fail", "skip", "pass")

CSS = """
:root { --fail: #c62828; --fail-med: #ef6c00; --fail-low: #f9a825; --fail-info: #5c6bc0; --pass: #2e7d32; --skip: #9e9e9e; }
body { font: 14px/1.45 system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px; color: #1d1d1f; background: #fafafa; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.inputs { color: #555; margin: 0 0 12px; } .inputs code { background: #eee; padding: 0 4px; border-radius: 3px; }
.summary { display: flex; gap: 12px; flex-wrap: wrap; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 90px; }
.card b { display: block; font-size: 20px; }
.exit-0 b { color: var(--pass); } .exit-1 b { color: var(--fail-med); } .exit-2 b { color: var(--fail); }
table { border-collapse: collapse; background: #fff; }
#heatmap th, #heatmap td { border: 1px solid #ccc; padding: 0; text-align: center; }
#heatmap th { padding: 6px 12px; background: #f0f0f0; font-weight: 600; }
#heatmap td.cell { width: 96px; height: 48px; font-size: 18px; font-weight: 700; cursor: pointer; color: #fff; }
#heatmap td.cell:focus { outline: 3px solid #1565c0; outline-offset: -3px; }
td.status-fail.sev-high { background: var(--fail); } td.status-fail.sev-medium { background: var(--fail-med); }
td.status-fail.sev-low { background: var(--fail-low); color: #222; } td.status-fail.sev-info { background: var(--fail-info); }
td.status-skip { background: var(--skip); } td.status-pass { background: var(--pass); }
td.status-none { background: #fff; color: #bbb; cursor: default; font-weight: 400; }
#heatmap-caption { min-height: 3.2em; margin: 8px 0; color: #333; max-width: 900px; }
.legend span { display: inline-block; padding: 1px 8px; margin-right: 6px; border-radius: 3px; color: #fff; font-size: 12px; }
.filters { display: flex; gap: 10px; align-items: center; flex-wrap: wrap; margin-bottom: 8px; }
#rules th, #rules td { border-bottom: 1px solid #e4e4e4; padding: 6px 8px; vertical-align: top; text-align: left; }
#rules th { background: #f0f0f0; position: sticky; top: 0; }
#rules td.detail { font-family: ui-monospace, monospace; font-size: 12px; word-break: break-word; max-width: 520px; }
.badge { display: inline-block; padding: 0 7px; border-radius: 10px; color: #fff; font-size: 12px; font-weight: 600; }
.badge.fail { background: var(--fail); } .badge.pass { background: var(--pass); } .badge.skip { background: var(--skip); }
.fix { color: #555; font-size: 12px; margin-top: 4px; }
"""

SCRIPT = """
(function () {
  const rows = Array.from(document.querySelectorAll('#rules tbody tr'));
  const cells = Array.from(document.querySelectorAll('#heatmap td.cell'));
  const f = { status: document.getElementById('f-status'), component: document.getElementById('f-component'),
              severity: document.getElementById('f-severity'), text: document.getElementById('f-text') };
  const caption = document.getElementById('heatmap-caption');
  function apply() {
    const q = f.text.value.trim().toLowerCase();
    let shown = 0;
    for (const r of rows) {
      const ok = (!f.status.value || r.dataset.status === f.status.value)
        && (!f.component.value || r.dataset.component === f.component.value)
        && (!f.severity.value || r.dataset.severity === f.severity.value)
        && (!q || r.textContent.toLowerCase().includes(q));
      r.hidden = !ok;
      if (ok) shown++;
    }
    document.getElementById('shown-count').textContent = shown + ' of ' + rows.length + ' rules';
    window.gemelCheck.shown = shown;
  }
  function describe(c) {
    caption.textContent = c.dataset.component + ' / ' + c.dataset.severity + ': ' + (c.dataset.caption || 'no rules');
  }
  for (const el of Object.values(f)) el.addEventListener('input', apply);
  for (const c of cells) {
    c.addEventListener('mouseenter', () => describe(c));
    c.addEventListener('focus', () => describe(c));
    c.addEventListener('click', () => {
      if (c.dataset.status === 'none') return;
      f.component.value = c.dataset.component; f.severity.value = c.dataset.severity; f.status.value = '';
      describe(c); apply();
    });
  }
  document.getElementById('f-reset').addEventListener('click', () => {
    for (const k of ['status', 'component', 'severity', 'text']) f[k].value = '';
    apply();
  });
  window.gemelCheck = { ready: true, rows: rows.length, cells: cells.length, shown: rows.length };
  apply();
})();
"""


def _cell_status(findings: list[Finding]) -> str:
    statuses = {f.status for f in findings}
    return next((s for s in STATUS_ORDER if s in statuses), "none")


def heatmap(report: Report) -> list[dict]:
    """One dict per (component, severity) cell: its rules, worst status and failed count."""
    cells = []
    for component in COMPONENTS:
        for severity in HEAT_SEVERITIES:
            fs = [f for f in report.findings if f.rule.component == component and f.rule.severity == severity]
            cells.append({"component": component, "severity": severity, "status": _cell_status(fs),
                          "failed": sum(f.status == "fail" for f in fs),
                          "rules": [f"{f.rule.id} {f.status}" for f in fs]})  # fmt: skip
    return cells


def _options(name: str, values: tuple[str, ...]) -> str:
    opts = "".join(f'<option value="{v}">{v}</option>' for v in values)
    return f'<label>{name} <select id="f-{name}"><option value="">all</option>{opts}</select></label>'


def render_html(report: Report) -> str:
    s = report.summary()
    inputs = " · ".join(f"{escape(k)}: <code>{escape(str(v))}</code>" for k, v in report.inputs.items() if v)
    cards = [("rules", s["rules"]), ("pass", s["pass"]), ("fail", s["fail"]), ("skipped", s["skip"])]
    cards += [(f"failed {sev}", n) for sev, n in s["failed_by_severity"].items()]
    summary = "".join(f'<div class="card"><b>{n}</b>{escape(label)}</div>' for label, n in cards)
    summary += f'<div class="card exit-{report.exit_code}" id="exit-code"><b>{report.exit_code}</b>exit code</div>'

    head = "".join(f"<th>{sev}</th>" for sev in HEAT_SEVERITIES)
    rows = []
    cells = heatmap(report)
    for component in COMPONENTS:
        tds = []
        for c in (c for c in cells if c["component"] == component):
            caption = ", ".join(c["rules"])
            text = str(c["failed"]) if c["status"] != "none" else "–"
            tds.append(
                f'<td class="cell status-{c["status"]} sev-{c["severity"]}" tabindex="0" data-component="{component}" '
                f'data-severity="{c["severity"]}" data-status="{c["status"]}" data-failed="{c["failed"]}" '
                f'data-caption="{escape(caption)}" title="{escape(caption or "no rules")}">{text}</td>'
            )
        rows.append(f"<tr><th>{component}</th>{''.join(tds)}</tr>")
    heat = f'<table id="heatmap"><thead><tr><th></th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'

    order = {"fail": 0, "skip": 1, "pass": 2}
    findings = sorted(report.findings, key=lambda f: (order[f.status], HEAT_SEVERITIES.index(f.rule.severity), f.rule.id))
    trs = []
    for f in findings:
        r = f.rule
        fix = f'<div class="fix">fix: {escape(r.fix)}</div>' if f.status == "fail" else ""
        trs.append(
            f'<tr data-rule="{r.id}" data-component="{r.component}" data-severity="{r.severity}" data-status="{f.status}">'
            f"<td><b>{r.id}</b></td><td>{r.component}</td><td>{r.severity}</td>"
            f'<td><span class="badge {f.status}">{f.status}</span></td>'
            f'<td>{escape(r.title)}<div class="fix">{escape(r.why)}</div>{fix}</td><td class="detail">{escape(f.detail)}</td></tr>'
        )
    table = ('<table id="rules"><thead><tr><th>rule</th><th>component</th><th>severity</th><th>status</th>'
             f'<th>checks</th><th>detail</th></tr></thead><tbody>{"".join(trs)}</tbody></table>')  # fmt: skip
    filters = ('<div class="filters">' + _options("status", ("fail", "skip", "pass")) + _options("component", COMPONENTS)
               + _options("severity", HEAT_SEVERITIES) + '<label>search <input id="f-text" type="search"></label>'
               + '<button id="f-reset" type="button">show all</button> <span id="shown-count"></span></div>')  # fmt: skip
    legend = ('<div class="legend"><span style="background:var(--fail)">fail</span><span style="background:var(--skip)">'
              'skipped</span><span style="background:var(--pass)">pass</span> worst status per cell, failures shaded by severity; the number counts failed rules</div>')  # fmt: skip
    data = json.dumps(report.as_dict()).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gemel check</title><style>{CSS}</style></head>
<body>
<h1>gemel check</h1>
<p class="inputs">{inputs}</p>
<div class="summary">{summary}</div>
<h2>Risk heatmap</h2>
{legend}
{heat}
<div id="heatmap-caption" aria-live="polite">Hover over a cell to list its rules; click it to filter the table.</div>
<h2>Rules</h2>
{filters}
{table}
<script type="application/json" id="check-data">{data}</script>
<script>{SCRIPT}</script>
</body></html>
"""
