"""The model card of a registered version: one page that says what the version is.

Rendering is pure: a typed ``ModelCard`` (built by the register step from the shard manifest, the
config, the run and the champion; ``data_facts`` reads the manifest) becomes Markdown
(``markdown``), the Markdown becomes a standalone HTML page (``html``, through markdown-it-py with
raw HTML off), and ``summary`` is the few lines the review's approval body shows. Every value that
comes from a user or a dataset (names, URIs, column and class names, config strings, a gate's
reason) goes through ``escape`` (Markdown punctuation backslash-escaped, ``<>&`` as entities,
newlines flattened) or into a code fence longer than any backtick run in it, so it can neither
break the card's tables nor inject markup.

Where a card lives (``log_card``, the one MLflow call site, mlflow imported inside): in the
version's training run, ``model_card/registered.{md,html,json}``, written by the register step
with the gate *pending* and the test metrics beside the champion's as registered (each on its
own test split; the card says whether the splits are the same). The review's gate task loads
the JSON again (``load_card``), adds the gate's result and the champion's figures on the
challenger's test split (``reviewed``), and logs ``model_card/reviewed.*`` to the same run and a
copy to its review run. The registration card is never rewritten: it is what was known when the
version was registered; a second review rewrites ``reviewed.*`` (each review run keeps its own
copy). The version's ``model_card`` / ``model_card.html`` tags (and the LoggedModel's) name the
newest card's artifact path in the version's run; its description names the registration card.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CARD_DIR = "model_card"
REGISTERED = "registered"
REVIEWED = "reviewed"
# Version (and LoggedModel) tags naming the newest card's artifacts in the version's run.
CARD_TAG = "model_card"
CARD_HTML_TAG = "model_card.html"
GATE_PENDING = "pending"
# The metrics a summary shows (the card's table shows every test metric).
HEADLINE = {"classification": ("accuracy_score", "f1_score"), "regression": ("test_rmse", "test_r2")}
SPLIT_ORDER = ("train", "val", "test")
# Rows of a long table the card shows (64 pixel columns would bury the rest).
MAX_ROWS = 40


def artifact_path(stem: str, ext: str) -> str:
    """``model_card/<stem>.<ext>``: where a card's file lives in a run."""
    return f"{CARD_DIR}/{stem}.{ext}"


# ---------------------------------------------------------------- the typed inputs


@dataclass(frozen=True)
class DataFacts:
    """What the card says of the data: the shard manifest's source, digests, splits and labels."""

    source_uri: str
    source_kind: str
    source_format: str
    source_sha256: str
    source_files: int
    source_bytes: int
    fingerprint: str
    manifest_uri: str
    manifest_digest: str
    sharded_at: str
    task: str  # "classification" or "regression"
    label_column: str
    num_features: int
    rows: dict[str, int]  # per split
    # classification: per split, {class value: rows}; regression: empty.
    labels: dict[str, dict[str, int]] = field(default_factory=dict)
    # regression: [{name, mean, std}] of the train split's targets (when standardised) and the
    # declared range; classification: empty.
    targets: list[dict[str, Any]] = field(default_factory=list)
    target_range: list[float] | None = None
    preprocessing: dict[str, Any] | None = None  # the manifest's record (fitted on the train split)
    feature_scaling: str | None = None


@dataclass(frozen=True)
class Training:
    """How the version was trained, what it cost and on what."""

    global_step: int
    epochs: int  # epochs recorded in the history (every attempt's)
    loop_seconds: float  # the training loop's time over the history's epochs (no evaluation)
    wall_seconds: float | None  # the MLflow run's start (training's start) to registration
    attempts: int
    restarts: int
    resumed_from_step: int
    backend: str
    num_workers: int
    num_servers: int
    device: str
    devices_per_worker: int
    instance_type: str
    cost: dict[str, float] = field(default_factory=dict)  # the run's cost.* metrics (training.tracking.cost)
    selection: dict[str, str] = field(default_factory=dict)  # registry.selection_tags


@dataclass(frozen=True)
class Lineage:
    dag_id: str
    run_id: str
    airflow_run_url: str
    mlflow_run_id: str
    mlflow_run_url: str
    checkpoints_prefix: str
    model_prefix: str
    shards_prefix: str
    logged_model_id: str


@dataclass(frozen=True)
class Champion:
    """The champion's figures beside the version's: ``version`` None when there is none yet."""

    version: str | None
    metrics: dict[str, float] = field(default_factory=dict)
    basis: str = ""  # which test split the two sets of figures are from


@dataclass(frozen=True)
class Gate:
    status: str  # GATE_PENDING, "passed" or "failed"
    reason: str = ""
    table: str = ""  # training.tracking.gate.markdown (built from numbers and metric names)
    review_run_id: str = ""


@dataclass(frozen=True)
class ModelCard:
    name: str
    version: str
    created_at: str
    data: DataFacts
    config: dict[str, Any]
    config_digest: str
    git_commit: str
    model_code_sha256: str  # a custom network's staged code; "" for a built-in one
    model_sha256: str  # the exported model's bytes (registry.files_digest)
    test_metrics: dict[str, float]
    champion: Champion
    gate: Gate
    training: Training
    lineage: Lineage

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelCard:
        """Back from ``to_dict`` (the card's JSON artifact)."""
        parts = {"data": DataFacts, "champion": Champion, "gate": Gate, "training": Training, "lineage": Lineage}
        return cls(**{k: parts[k](**v) if k in parts else v for k, v in raw.items()})


def data_facts(manifest: Mapping[str, Any], *, manifest_uri: str, digest: str) -> DataFacts:
    """The card's data section from a shard manifest (``data_checks.shard``'s, format 1 or 2)."""
    regression = manifest.get("task") == "regression"
    classes = [str(c) for c in manifest.get("classes") or []]
    raw = manifest.get("splits") or {}
    # train, val, test first (the manifest's JSON has its keys sorted)
    splits = {k: raw[k] for k in sorted(raw, key=lambda k: (SPLIT_ORDER.index(k) if k in SPLIT_ORDER else 9, k))}
    labels = {} if regression else {
        split: {classes[int(k)] if int(k) < len(classes) else k: int(n)
                for k, n in (info.get("label_histogram") or {}).items()}
        for split, info in splits.items()}
    prep = manifest.get("preprocessing")
    source = manifest.get("source") or {}
    return DataFacts(
        source_uri=str(manifest.get("source_uri", "")), source_kind=str(manifest.get("source_kind", "")),
        source_format=str(manifest.get("source_format", "")), source_sha256=str(manifest.get("source_sha256", "")),
        source_files=int(source.get("num_files", 0)), source_bytes=int(source.get("bytes", 0)),
        fingerprint=str(manifest.get("source_fingerprint", "")), manifest_uri=manifest_uri, manifest_digest=digest,
        sharded_at=str(manifest.get("created_at", "")), task="regression" if regression else "classification",
        label_column=", ".join(manifest.get("target_columns") or []) if regression
        else str(manifest.get("label_column") or ""),
        num_features=int(manifest.get("num_features", 0)),
        rows={split: int(info.get("count", 0)) for split, info in splits.items()}, labels=labels,
        targets=list((prep or {}).get("targets") or []) if regression else [],
        target_range=manifest.get("declared_target_range") if regression else None,
        preprocessing=prep, feature_scaling=manifest.get("feature_scaling"))


def loop_seconds(history: Sequence[Mapping[str, Any]]) -> float:
    """The training loop's time over the epoch history: each epoch's steps (its ``global_step``
    less the previous one's) times its ``step_time_s``; the evaluation and epoch-end checkpoint
    are not in it. A restored history (a resumed job's) includes the earlier attempts' epochs."""
    total, previous = 0.0, 0
    for record in history:
        step = int(record.get("global_step", previous))
        total += max(step - previous, 0) * float(record.get("step_time_s", 0.0))
        previous = step
    return total


def reviewed(card: ModelCard, outcome: Mapping[str, Any], challenger: Mapping[str, float],
             champion_version: str | None, champion: Mapping[str, float] | None, review_run_id: str) -> ModelCard:
    """The card again after the review's gate: its result and table, and both versions' figures
    on the challenger's test split (``challenger``/``champion``: the review's evaluator metrics)."""
    failed = not outcome["passed"]
    gate = Gate(status="failed" if failed else "passed", reason=str(outcome.get("reason") or ""),
                table=str(outcome.get("markdown") or ""), review_run_id=review_run_id)
    basis = "the review's evaluation of both versions on this version's test split"
    return dataclasses.replace(card, gate=gate, test_metrics={**card.test_metrics, **challenger},
                               champion=Champion(champion_version, dict(champion or {}), basis))


# ---------------------------------------------------------------- Markdown


_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+!|~])")


def escape(value: Any) -> str:
    """User-provided text as inert Markdown: punctuation that would start markup backslash-escaped,
    ``<``, ``>`` and ``&`` as entities (no raw HTML), line breaks flattened (a table row stays one)."""
    text = " ".join(str(value).splitlines())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", text)


def link(label: str, url: str) -> str:
    """``[label](url)`` for an http(s) URL; anything else (an s3:// prefix, empty) as escaped text."""
    if not url:
        return "–"
    if not url.startswith(("http://", "https://")):
        return escape(url)
    # Percent-encode what would end the destination early (spaces, parentheses, angle brackets).
    safe = urllib.parse.quote(url, safe=":/?&=#%+@,;~!$'*-._")
    return f"[{escape(label)}]({safe})"


def fenced(text: str, info: str = "") -> str:
    """A code block whose fence is longer than any backtick run in ``text``."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text}\n{fence}"


def _num(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f} s"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    shown = rows[:MAX_ROWS]
    lines += ["| " + " | ".join(r) + " |" for r in shown]
    if len(rows) > len(shown):
        lines.append("| " + " | ".join([f"… {len(rows) - len(shown)} more"] + [""] * (len(head) - 1)) + " |")
    return lines


def _data_section(d: DataFacts) -> list[str]:
    lines = ["## Data", "",
             f"- **Source**: {escape(d.source_uri)} ({escape(d.source_kind)}, {escape(d.source_format)}; "
             f"{d.source_files} file(s), {d.source_bytes} bytes)",
             f"- **Source sha256**: {escape(d.source_sha256)}",
             f"- **Shards fingerprint**: {escape(d.fingerprint)}",
             f"- **Manifest**: {escape(d.manifest_uri)} (digest {escape(d.manifest_digest)}, sharded "
             f"{escape(d.sharded_at)})",
             f"- **Task**: {d.task}; {'targets' if d.task == 'regression' else 'label column'}: "
             f"{escape(d.label_column)}; {d.num_features} features", ""]
    splits = list(d.rows)
    lines += ["### Rows per split", ""] + _table(splits, [[str(d.rows[s]) for s in splits]]) + [""]
    if d.labels:
        classes = sorted({c for hist in d.labels.values() for c in hist})
        lines += ["### Labels per split", ""]
        lines += _table(["class", *splits], [[escape(c), *(str(d.labels[s].get(c, 0)) for s in splits)]
                                             for c in classes])
        lines.append("")
    if d.task == "regression":
        lines += ["### Targets", ""]
        if d.targets:
            lines += _table(["target", "train mean", "train std"],
                            [[escape(t["name"]), _num(float(t["mean"])), _num(float(t["std"]))] for t in d.targets])
        else:
            lines.append("Train mean and std not recorded (the targets are not standardised).")
        if d.target_range:
            lines += ["", f"Declared range: {_num(float(d.target_range[0]))} to {_num(float(d.target_range[1]))}."]
        lines.append("")
    return lines


def _preprocessing_section(card: ModelCard) -> list[str]:
    d, prep = card.data, card.data.preprocessing
    lines = ["## Preprocessing", ""]
    if d.feature_scaling:
        lines += [f"Features: {escape(d.feature_scaling)}.", ""]
    if not prep:
        return lines if d.feature_scaling else lines + ["No fitted preprocessing: the features are used as read.", ""]
    lines += [f"Fitted on the train split, applied to every split and inside the registered model "
              f"(standardize: {escape(prep.get('standardize'))}, missing values: "
              f"{escape(prep.get('missing_values', '–'))}).", ""]
    rows = []
    for col in prep.get("inputs", []):
        if col.get("kind") == "categorical":
            what = f"one-hot of {len(col.get('categories', []))} categories (+ unknown)"
        else:
            what = f"mean {_num(float(col.get('mean', 0.0)))}, std {_num(float(col.get('std', 1.0)))}"
        fill = col.get("fill")
        rows.append([escape(col.get("name", "")), escape(col.get("kind", "")), what,
                     "–" if fill is None else escape(fill)])
    lines += _table(["input", "kind", "transform", "missing filled with"], rows) + [""]
    return lines


def _code_section(card: ModelCard) -> list[str]:
    return ["## Config and code", "",
            f"- **Config digest**: {escape(card.config_digest)}",
            f"- **Code commit**: {escape(card.git_commit or 'unknown')}",
            f"- **Custom network code sha256**: {escape(card.model_code_sha256 or 'none (a built-in network)')}",
            f"- **Model files sha256**: {escape(card.model_sha256)}", "",
            "Resolved config:", "",
            fenced(json.dumps(card.config, indent=2, sort_keys=True), "json"), ""]


def _metrics_section(card: ModelCard) -> list[str]:
    ch = card.champion
    lines = ["## Test metrics", ""]
    if ch.version is None:
        lines += ["There is no champion yet (no version has the `champion` alias): nothing to compare with.", ""]
    else:
        lines += [f"Beside champion version {escape(ch.version)}: {escape(ch.basis)}.", ""]
    rows = []
    for key in sorted(card.test_metrics):
        mine = card.test_metrics[key]
        theirs = ch.metrics.get(key)
        delta = None if theirs is None else mine - theirs
        rows.append([escape(key), _num(mine), _num(theirs), "–" if delta is None else f"{delta:+.4f}"])
    lines += _table(["metric", f"version {escape(card.version)}", "champion", "Δ"], rows) + [""]
    return lines


def _gate_section(card: ModelCard) -> list[str]:
    g = card.gate
    lines = ["## Gate", ""]
    if g.status == GATE_PENDING:
        return lines + ["Pending: the review (DAG `model_review`) runs the gate; its card adds the result.", ""]
    head = "**Passed.**" if g.status == "passed" else f"**Failed**: {escape(g.reason)}."
    lines += [f"{head} Review run {escape(g.review_run_id)}.", ""]
    if g.table:
        # The gate's table (training.tracking.gate.markdown) without its own headline.
        lines += [line for line in g.table.splitlines() if line.startswith("|")] + [""]
    return lines


def _training_section(t: Training) -> list[str]:
    hardware = (f"{t.num_workers} worker(s) × {t.devices_per_worker} {escape(t.device)} context(s), "
                f"{t.num_servers} server(s), backend {escape(t.backend)}"
                + (f", instance type {escape(t.instance_type)}" if t.instance_type else ""))
    lines = ["## Training, cost and hardware", "",
             f"- **Hardware**: {hardware}",
             f"- **Steps**: {t.global_step} over {t.epochs} epoch(s); resumed from step {t.resumed_from_step}; "
             f"{t.attempts} attempt(s), {t.restarts} in-place restart(s)",
             f"- **Time**: training loop {_seconds(t.loop_seconds)}; run start to registration "
             f"{_seconds(t.wall_seconds)}"]
    if t.selection:
        lines.append(f"- **Exported epoch**: {escape(t.selection.get('model.epoch_exported', '–'))} (best "
                     f"{escape(t.selection.get('best.metric', '–'))} at epoch {escape(t.selection.get('best.epoch', '–'))}"
                     f", early stopped: {escape(t.selection.get('early_stopped_at', '–'))})")
    lines.append("")
    if t.cost:
        lines += _table(["cost", "value"], [[escape(k), _num(v, 3)] for k, v in sorted(t.cost.items())])
    else:
        lines.append("No cost metrics on the run (its live tracking did not record any).")
    return lines + [""]


def _lineage_section(card: ModelCard) -> list[str]:
    ln = card.lineage
    return ["## Lineage", "",
            f"- **Airflow run**: {link(f'{ln.dag_id} / {ln.run_id}', ln.airflow_run_url)} "
            f"({escape(ln.dag_id)}, {escape(ln.run_id)})",
            f"- **MLflow run**: {link(ln.mlflow_run_id, ln.mlflow_run_url)} ({escape(ln.mlflow_run_id)})",
            f"- **Logged model**: {escape(ln.logged_model_id or '–')}",
            f"- **Checkpoints**: {escape(ln.checkpoints_prefix or '–')}",
            f"- **Exported model**: {escape(ln.model_prefix or '–')}",
            f"- **Shards**: {escape(ln.shards_prefix)}", ""]


def markdown(card: ModelCard) -> str:
    """The whole card as Markdown: data, preprocessing, config and code, test metrics beside the
    champion's, the gate, training (time, cost, hardware) and lineage."""
    head = [f"# Model card: {escape(card.name)} version {escape(card.version)}", "",
            f"{card.data.task.capitalize()} model, card written {escape(card.created_at)}.", ""]
    sections = (_data_section(card.data) + _preprocessing_section(card) + _code_section(card)
                + _metrics_section(card) + _gate_section(card) + _training_section(card.training)
                + _lineage_section(card))
    return "\n".join(head + sections).rstrip() + "\n"


def summary(card: ModelCard, card_uri: str = "") -> str:
    """The card in a few lines, for the review's approval body (Markdown)."""
    d, t, ch = card.data, card.training, card.champion
    figures = []
    for key in HEADLINE[d.task]:
        if key in card.test_metrics:
            mine, theirs = card.test_metrics[key], ch.metrics.get(key)
            versus = "" if theirs is None else f" (champion {_num(theirs)}, Δ {mine - theirs:+.4f})"
            figures.append(f"{key} {_num(mine)}{versus}")
    champion = f"champion version {escape(ch.version)}" if ch.version else "no champion yet"
    gate = {"pending": "pending", "passed": "passed"}.get(card.gate.status, f"failed: {escape(card.gate.reason)}")
    cost = t.cost.get("cost.core_seconds")
    usd = t.cost.get("cost.usd")
    rows = "/".join(str(d.rows.get(s, 0)) for s in ("train", "val", "test"))
    lines = [f"**Model card** of {escape(card.name)} version {escape(card.version)}"
             + (f" ({escape(card_uri)})" if card_uri else "") + ":",
             f"- data: {escape(d.source_uri)}, manifest {escape(d.manifest_digest[:12])}, "
             f"{rows} train/val/test rows",
             f"- config {escape(card.config_digest)}, commit {escape(card.git_commit[:12] or 'unknown')}",
             f"- test ({champion}): {'; '.join(figures) or 'no test metrics'}",
             f"- gate: {gate}",
             f"- training: {t.global_step} steps, {t.num_workers} worker(s) / {t.num_servers} server(s) "
             f"({escape(t.backend)}, {escape(t.device)}), loop {_seconds(t.loop_seconds)}"
             + ("" if cost is None else f", {cost:.1f} core-seconds") + ("" if usd is None else f", USD {usd:.2f}"),
             f"- lineage: {link('Airflow run', card.lineage.airflow_run_url)}, "
             f"{link('MLflow run', card.lineage.mlflow_run_url)}, checkpoints "
             f"{escape(card.lineage.checkpoints_prefix or '–')}"]
    return "\n".join(lines)


# ---------------------------------------------------------------- HTML


def html(markdown_text: str, title: str) -> str:
    """A standalone HTML page of the card's Markdown: CommonMark plus tables (markdown-it-py),
    raw HTML off, so any markup in the text arrives escaped; markdown-it also refuses
    ``javascript:``-style link targets."""
    from html import escape as html_escape

    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown_text)
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}"
             "pre{background:#f6f6f6;padding:8px;overflow:auto}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html_escape(title)}</title>"
            f"<style>{style}</style></head>\n<body>\n{body}</body></html>\n")


# ---------------------------------------------------------------- MLflow side


def log_card(client: Any, card: ModelCard, run_id: str, stem: str, *, copy_to_run: str | None = None) -> dict[str, str]:
    """Log the card's Markdown, HTML and JSON to ``run_id`` under ``model_card/<stem>.*`` (and the
    Markdown and HTML to ``copy_to_run`` under ``review/``), and point the version's and its
    LoggedModel's ``model_card`` tags at them. Returns ``{"markdown", "html", "summary"}``: the
    artifact paths and the summary."""
    text = markdown(card)
    page = html(text, f"Model card: {card.name} version {card.version}")
    md_path, html_path = artifact_path(stem, "md"), artifact_path(stem, "html")
    client.log_text(run_id, text, md_path)
    client.log_text(run_id, page, html_path)
    client.log_dict(run_id, card.to_dict(), artifact_path(stem, "json"))
    if copy_to_run:
        client.log_text(copy_to_run, text, "review/model_card.md")
        client.log_text(copy_to_run, page, "review/model_card.html")
    tags = {CARD_TAG: md_path, CARD_HTML_TAG: html_path}
    for key, value in tags.items():
        client.set_model_version_tag(card.name, card.version, key, value)
    if card.lineage.logged_model_id:
        client.set_logged_model_tags(card.lineage.logged_model_id, tags)
    return {"markdown": md_path, "html": html_path, "summary": summary(card, f"runs:/{run_id}/{html_path}")}


def load_card(client: Any, run_id: str, stem: str = REGISTERED) -> ModelCard | None:
    """The card JSON logged to ``run_id`` (None when there is none: a version registered before
    cards, or outside the training DAG)."""
    import os
    import tempfile

    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="mxpipe-card-") as tmp:
        try:
            local = client.download_artifacts(run_id, artifact_path(stem, "json"), tmp)
        except (MlflowException, OSError):
            return None
        if not os.path.isfile(local):
            return None
        with open(local, encoding="utf-8") as f:
            return ModelCard.from_dict(json.load(f))
