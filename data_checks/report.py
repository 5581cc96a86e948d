"""The validation report: one JSON document, a small HTML page, and the failure message.

The JSON holds every per-shard GX result and every cross-shard check. The HTML page is
rendered here (a summary, the failures, the warnings, the checks) and links each shard's
Great Expectations Data Docs page (``shards/{name}.html``) when the run built one. The message
groups a failure that repeats over shards into one line, with counts per shard and examples.
"""
from __future__ import annotations

import html
import json
import math
from datetime import datetime, timezone
from typing import Any

import numpy as np

from common import storage
from common.manifest import manifest_digest, manifest_uri

REPORT_NAME = "validation.json"
HTML_NAME = "validation.html"
_EXAMPLES = 5


def build(manifest: dict[str, Any], prefix: str, outcomes: dict[str, Any], checks: list[dict[str, Any]],
          seconds: float) -> dict[str, Any]:
    shards = {name: (o.result if o is not None else None) for name, o in outcomes.items()}
    failures: list[dict[str, Any]] = []
    for name, result in shards.items():
        for f in (result or {}).get("failures", []):
            failures.append({**f, "shard": name})
    failures += [f for c in checks if c["severity"] == "fail" for f in c["failures"]]
    warnings = [f for c in checks if c["severity"] == "warn" for f in c["failures"]]
    rows = sum((r or {}).get("rows", 0) for r in shards.values())
    shard_seconds = sum((r or {}).get("seconds", 0.0) for r in shards.values())
    drift = next((c for c in checks if c["check"] == "label_drift"), None)
    return {
        "success": not failures,
        "manifest_uri": manifest_uri(prefix),
        "manifest_digest": manifest_digest(manifest),
        "source_fingerprint": manifest.get("source_fingerprint"),
        "validated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": seconds,
        "rows": rows,
        "rows_per_s": round(rows / shard_seconds, 1) if shard_seconds else None,
        "evaluated": sum((r or {}).get("evaluated", 0) for r in shards.values()) + len(checks),
        "failures": failures,
        "warnings": warnings,
        "checks": checks,
        "drift": {k: drift.get(k) for k in ("distance", "threshold", "severity", "skipped", "previous_manifest_uri",
                                            "new_classes", "missing_classes") if k in drift} if drift else None,
        "shards": shards,
        # Missing values replaced at shard time (data.missing_values='impute'), per split and column.
        "imputed": (manifest.get("preprocessing") or {}).get("imputed") or {},
    }


def write(report: dict[str, Any], report_prefix: str) -> dict[str, str]:
    uris = {"json": storage.join(report_prefix, REPORT_NAME), "html": storage.join(report_prefix, HTML_NAME)}
    storage.put_bytes(uris["json"], json.dumps(jsonable(report), indent=2, sort_keys=True).encode())
    storage.put_bytes(uris["html"], render_html(report).encode())
    return uris


def _group(failures: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """GX failures that repeat over shards share a line; plain checks carry their own message."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for i, f in enumerate(failures):
        key = (i,) if "message" in f else (f["expectation"], f.get("column"), f.get("description"))
        groups.setdefault(key, []).append(f)
    return list(groups.values())


def message(report: dict[str, Any], report_uri: str | None) -> str:
    failures = report["failures"]
    lines = [f"shard validation failed for {report['manifest_uri']}: {len(failures)} failed of "
             f"{report['evaluated']} checks"]
    for group in _group(failures):
        f = group[0]
        if "message" in f:
            lines.append(f"- {f['expectation']}: {f['message']}")
            continue
        column = f"({f['column']})" if f.get("column") else ""
        text = f"- {f['expectation']}{column}"
        if f.get("description"):
            text += f" [{f['description']}]"
        unexpected = sum(g.get("unexpected_count") or 0 for g in group)
        per_shard = "; ".join(f"{g.get('shard')}: {g.get('unexpected_count')} of {g.get('element_count')}"
                              for g in group[:_EXAMPLES])
        text += f": {unexpected} unexpected in {len(group)} shard(s) ({per_shard}{' …' if len(group) > _EXAMPLES else ''})"
        counts: dict[str, int] = {}
        for g in group:
            for c, n in (g.get("column_counts") or {}).items():
                counts[c] = counts.get(c, 0) + n
        if counts:
            shown = [f"{c} ({n})" for c, n in list(counts.items())[:10]]
            text += f"; columns {', '.join(shown)}{f' and {len(counts) - 10} more' if len(counts) > 10 else ''}"
        if f.get("missing_count"):
            text += f"; {f['missing_count']} missing"
        if f.get("observed_value") is not None:
            text += f"; observed {short(f['observed_value'])}"
        examples = [e for g in group for e in (g.get("values") or g.get("examples") or [])][:_EXAMPLES]
        if examples:
            text += f"; e.g. {short(examples)}"
        if f.get("exception"):
            text += f"; error: {f['exception']}"
        lines.append(text)
    if report_uri:
        lines.append(f"full report: {report_uri}")
    return "\n".join(lines)


def short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def jsonable(value: Any) -> Any:
    """Strict JSON: NaN/inf become strings, numpy scalars become Python ones."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(report: dict[str, Any]) -> str:
    esc = html.escape
    ok = report["success"]
    shard_rows = []
    for name, r in report["shards"].items():
        if r is None:
            shard_rows.append([esc(name), "", "", "<b>not validated</b>", "", "", ""])
            continue
        link = f'<a href="shards/{esc(name)}.html">GX page</a>' if r.get("html_uri") else ""
        shard_rows.append([esc(name), esc(r.get("split", "")), r.get("rows", 0),
                           "pass" if r["success"] else f"<b>{len(r['failures'])} failed</b>",
                           r.get("seconds", ""), r.get("rows_per_s", ""), link])
    fail_rows = [[esc(str(f.get("shard") or "all")), esc(f["expectation"]), esc(str(f.get("column") or "")),
                  esc(str(f.get("unexpected_count", ""))),
                  esc(f.get("message") or short(f.get("values") or f.get("examples") or ""))]
                 for f in report["failures"]]
    warn_rows = [[esc(w["expectation"]), esc(w.get("message", ""))] for w in report["warnings"]]
    imputed_rows = [[esc(split), esc(column), n] for split, columns in report.get("imputed", {}).items()
                    for column, n in columns.items()]
    check_rows = [[esc(c["check"]), "pass" if c["success"] else c["severity"], esc(c["description"]),
                   esc(c.get("skipped", ""))] for c in report["checks"]]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>Shard validation</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}}
.ok{{color:#080}}.bad{{color:#b00}}</style></head><body>
<h1 class="{'ok' if ok else 'bad'}">Shard validation {'passed' if ok else 'FAILED'}</h1>
<p>Manifest <code>{esc(report['manifest_uri'])}</code> (digest <code>{esc(report['manifest_digest'][:16])}</code>),
{report['rows']} rows, {report['evaluated']} checks, {report['seconds']} s, validated {esc(report['validated_at'])}.</p>
<h2>Failures ({len(report['failures'])})</h2>{_table(['shard', 'expectation', 'column', 'count', 'details / examples'], fail_rows)}
<h2>Warnings ({len(report['warnings'])})</h2>{_table(['check', 'details'], warn_rows)}
<h2>Shards</h2>{_table(['shard', 'split', 'rows', 'result', 'seconds', 'rows/s', 'Data Docs'], shard_rows)}
<h2>Imputed values ({sum(r[2] for r in imputed_rows)})</h2>{_table(['split', 'column', 'values'], imputed_rows)}
<h2>Cross-shard checks</h2>{_table(['check', 'result', 'description', 'skipped'], check_rows)}
<h2>Label drift</h2><pre>{esc(json.dumps(jsonable(report.get('drift')), indent=2))}</pre>
</body></html>"""


def shard_message(result: dict[str, Any]) -> str:
    """The failure message of one shard's validation (the mapped task's error)."""
    failures = [{**f, "shard": result["shard"]} for f in result["failures"]]
    head = {"manifest_uri": f"shard {result['shard']}", "evaluated": result.get("evaluated", 0), "failures": failures}
    return message(head, result.get("report_uri"))
