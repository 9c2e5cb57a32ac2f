#!/usr/bin/env python3
"""Checks that the Prometheus rules, their tests and the Grafana dashboard use only metric
names the relay exports, and that docs/observability.md documents every exported metric.

    python3 deploy/check_metric_names.py

The exported names come from src/metrics.rs: each name passed to `registry.register` (or
listed in the counters array beside it) with the type of the `Metrics` field it registers.
prometheus-client exports a counter `x` as `x_total` and a histogram `x` as `x_bucket`,
`x_sum` and `x_count`; a gauge keeps its name.

Exits 1 when a file names an `outbox_*` metric that is not exported (or the docs miss one),
2 when src/metrics.rs cannot be read the way this script expects.
"""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METRICS_RS = ROOT / "src" / "metrics.rs"
RULES = [ROOT / "deploy/prometheus/alerts.yml", ROOT / "deploy/prometheus/alerts_test.yml"]
DASHBOARD = ROOT / "deploy/grafana/outbox-relay.json"
DOCS = ROOT / "docs/observability.md"

# A metric name inside a PromQL expression or a test series.
NAME = re.compile(r"\boutbox_[a-z0-9_]+\b")
# A selector's label matchers, removed before looking for names...
MATCHERS = re.compile(r"\{[^{}]*\}")
# ...except a metric named by `__name__`.
NAME_MATCHER = re.compile(r'__name__\s*=~?\s*"(outbox_[a-z0-9_]+)"')


def unreadable(why):
    print(f"{METRICS_RS.relative_to(ROOT)}: {why}", file=sys.stderr)
    sys.exit(2)


def exported_metrics():
    """{exported sample name: base name} and {base name: kind}, from src/metrics.rs."""
    src = METRICS_RS.read_text()
    struct = re.search(r"pub struct Metrics \{(.*?)\n\}", src, re.S)
    if not struct:
        unreadable("no `pub struct Metrics`")
    field_kind = {}
    for field, ty in re.findall(r"^\s*pub (\w+): (.+),\s*$", struct.group(1), re.M):
        if "Histogram" in ty:
            field_kind[field] = "histogram"
        elif "Counter" in ty:
            field_kind[field] = "counter"
        elif "Gauge" in ty:
            field_kind[field] = "gauge"
    registered = re.findall(r'"(outbox_[a-z0-9_]+)",\s*"[^"]*",\s*&?m\.(\w+)', src)
    if not registered:
        unreadable("found no registered metric")
    kinds = {}
    for name, field in registered:
        if field not in field_kind:
            unreadable(f"{name} registers m.{field}, whose type is unknown")
        kinds[name] = field_kind[field]
    samples = {}
    for name, kind in kinds.items():
        if kind == "counter":
            samples[name + "_total"] = name
        elif kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                samples[name + suffix] = name
        else:
            samples[name] = name
    return samples, kinds


def exprs_of_rules(path):
    """The PromQL and series text of a rules or rules-test file (annotations are prose)."""
    out = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        out.append(line)
    text = "\n".join(out)
    # Keep `expr:` blocks and `series:` lines; drop annotation prose, which may quote names
    # that are not metrics (the slot `outbox_relay`, the table `outbox_events`).
    keep = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"(\s*)(?:- )?(expr|series):\s*(.*)$", line)
        if m:
            keep.append(m.group(3))
            indent = len(m.group(1))
            j = i + 1
            if m.group(3).strip() in ("|", ">", "|-", ">-"):
                while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                    keep.append(lines[j])
                    j += 1
            i = j
            continue
        i += 1
    return keep


def exprs_of_dashboard(path):
    dash = json.loads(path.read_text())
    found = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    found.append(value)
                elif key == "query" and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dash)
    return found


def main():
    samples, kinds = exported_metrics()
    problems = []
    used = set()
    sources = [(p, exprs_of_rules(p)) for p in RULES] + [(DASHBOARD, exprs_of_dashboard(DASHBOARD))]
    for path, texts in sources:
        if not texts:
            problems.append(f"{path.relative_to(ROOT)}: no expressions found")
        for text in texts:
            # Label matchers (`{outbox_mode!="poll"}`) name labels, not metrics.
            names = NAME.findall(MATCHERS.sub("", text)) + NAME_MATCHER.findall(text)
            for name in names:
                used.add(name)
                if name not in samples:
                    problems.append(f"{path.relative_to(ROOT)}: {name} is not exported by the relay")
    if DOCS.exists():
        doc = DOCS.read_text()
        for sample, base in sorted(samples.items()):
            if sample.endswith(("_bucket", "_sum", "_count")):
                sample = base
            if f"`{sample}" not in doc:
                problems.append(f"docs/observability.md does not document {sample}")
    else:
        problems.append("docs/observability.md is missing")
    for p in sorted(set(problems)):
        print(p, file=sys.stderr)
    if problems:
        return 1
    print(f"ok: {len(kinds)} metrics exported, {len(used)} sample names used, all known")
    return 0


if __name__ == "__main__":
    sys.exit(main())
