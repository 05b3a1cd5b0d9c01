"""What a figure run leaves behind, and what is published of it.

A run writes comparison.csv and comparison.md (one row per comparison row, beside the
published value and verdict of the same row when there is one) and status.json (size,
verdict counts, causes, a one-line summary, the rows, and under "run" the machine, when
and how long). `publish` copies a run into the published results file by file, only
where the content changed, so republishing a bit-identical figure leaves the tree clean;
`write_results_readme` regenerates results/README.md from every figure's status.json.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from repro.durable import write_bytes, write_text
from repro.figures.registry import (
    Figure,
    default_results_root,
    extended_set,
    get,
    published_root,
    registered,
)
from repro.figures.verdicts import CAUSE_NAMES, VERDICTS, Row, causes_markdown, rules_markdown
from repro.runs import fmt

# -- comparison files and status ---------------------------------------------------------------


def value_text(r: Mapping[str, Any]) -> str:
    text = fmt(r.get("reproduced"))
    if r.get("low") is not None and r.get("high") is not None:
        text += f" [{fmt(r['low'], '.3g')}–{fmt(r['high'], '.3g')}]"
    return text


def row_key(r: Mapping[str, Any] | Row) -> tuple[str, str]:
    d = asdict(r) if isinstance(r, Row) else r
    return (d["setting"], d["metric"])


SMOKE_VERDICT = "pipeline check"  # what a smoke-size row shows in place of a verdict


def shown_verdict(verdict: str, smoke: bool) -> str:
    """A row's verdict as the console and comparison.md show it: at smoke size (a tiny
    run that checks the figure's pipeline) a pipeline check, its rule's verdict labelled
    as not comparable with the paper's."""
    return f"{SMOKE_VERDICT} (smoke size, not comparable: {verdict})" if smoke else verdict


def comparison_markdown(fig: Figure, rows: Sequence[Row],
                        published: Mapping[str, Any] | None = None, smoke: bool = False) -> str:
    """comparison.md: one table row per comparison row; with `published` (the published
    status.json) a column with the published value and verdict of the same row. smoke:
    the rows of a smoke-size run, each shown as a pipeline check (`shown_verdict`)."""
    lines = [f"# {fig.id}: {fig.title}", "", f"Paper claim: {fig.expected}", "",
             ("Reproduced values that are timed carry their interval in brackets (10th–90th "
              "percentile round by round over interleaved rounds, or step by step between two "
              "training runs); the rule that gave each verdict is in the rule column, and a "
              "row that does not hold names its cause in the cause column "
              "(`repro figure --rules`)."), ""]
    head = "| setting | metric | paper | reproduced | ratio | verdict |"
    sep = "|---|---|---|---|---|---|"
    pub_rows: dict[tuple[str, str], Mapping[str, Any]] = {}
    if published is not None:
        pub_rows = {row_key(r): r for r in published.get("rows", [])}
        run = published.get("run", published)
        lines.insert(4, f"Published reference: {published.get('size', '?')} run of "
                        f"{run.get('finished', '?')} on {(run.get('machine') or {}).get('kind', '?')}.")
        lines.insert(5, "")
        head += " published |"
        sep += "---|"
    if smoke:
        lines[4:4] = [(f"Smoke size: a {SMOKE_VERDICT} of this figure's code on a tiny run, not "
                       "a reproduction. Its numbers and the rules' verdicts are not comparable "
                       "with the paper's or the published ones; run the full size for those."),
                      ""]
    lines += [head + " rule | cause | reason |", sep + "---|---|---|"]
    for r in rows:
        unit = f" {r.unit}" if r.unit else ""
        cells = [r.setting, f"{r.metric}{unit}", fmt(r.paper), value_text(asdict(r)),
                 fmt(r.ratio), shown_verdict(r.verdict, smoke)]
        if published is not None:
            p = pub_rows.get(row_key(r))
            cells.append("—" if p is None else f"{value_text(p)}, {p['verdict']}")
        cells += [r.rule, r.cause or "", r.reason]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def comparison_csv_text(rows: Sequence[Row], published: Mapping[str, Any] | None = None) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    head = ["setting", "metric", "unit", "paper", "reproduced", "low", "high", "ratio",
            "verdict", "rule", "cause", "reason"]
    pub_rows = {row_key(r): r for r in (published or {}).get("rows", [])}
    if published is not None:
        head += ["published_reproduced", "published_verdict"]
    w.writerow(head)
    for r in rows:
        line = [r.setting, r.metric, r.unit, r.paper, r.reproduced, r.low, r.high, r.ratio,
                r.verdict, r.rule, r.cause, r.reason]
        if published is not None:
            p = pub_rows.get(row_key(r))
            line += [None, None] if p is None else [p.get("reproduced"), p.get("verdict")]
        w.writerow(line)
    return buf.getvalue()


def cause_counts(rows: Sequence[Row]) -> dict[str, int]:
    """How many rows that do not hold name each cause (causes none names left out)."""
    counts = {c: sum(r.cause == c for r in rows) for c in CAUSE_NAMES}
    return {c: n for c, n in counts.items() if n}


def summary_verdict(rows: Sequence[Row]) -> str:
    """One line: the counts (those that do not hold by cause), and the first row that
    does not hold (if any)."""
    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    causes = ", ".join(f"{n} {c}" for c, n in cause_counts(rows).items())
    text = ", ".join(f"{n} {v}" + (f" ({causes})" if v == "does not hold" else "")
                     for v, n in counts.items() if n)
    bad = [r for r in rows if r.verdict == "does not hold"]
    if bad:
        text += f"; e.g. does not hold: {bad[0].setting}, {bad[0].metric}"
    return text or "no comparison rows"


def verdict_changes(rows: Sequence[Row], published: Mapping[str, Any] | None
                    ) -> list[tuple[Row, str]]:
    """The rows whose verdict differs from the published one: (row, published verdict)."""
    if not published:
        return []
    pub = {row_key(r): r["verdict"] for r in published.get("rows", [])}
    return [(r, pub[row_key(r)]) for r in rows
            if row_key(r) in pub and pub[row_key(r)] != r.verdict]


def _content(status: Mapping[str, Any]) -> dict[str, Any]:
    """A status.json without its "run" section (when, how long, which machine, load)."""
    return {k: v for k, v in status.items() if k != "run"}


def status_of(fig: Figure, size: str, rows: Sequence[Row], run: Mapping[str, Any]
              ) -> dict[str, Any]:
    return {"id": fig.id, "size": size,
            "verdicts": {v: sum(r.verdict == v for r in rows) for v in VERDICTS},
            "causes": cause_counts(rows),
            "summary": summary_verdict(rows), "rows": [asdict(r) for r in rows],
            "run": dict(run)}


def read_status(figure_id: str, root: Path | None = None,
                folder: Path | None = None) -> dict[str, Any] | None:
    """<root>/<id>/status.json (root: the published results), or folder/status.json."""
    path = (folder if folder is not None else (root or default_results_root()) / figure_id) \
        / "status.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def run_info(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The "run" section of a status.json (older files keep its keys at the top level)."""
    if not status:
        return {}
    return dict(status.get("run") or status)


def status_line(figure_id: str, root: Path | None = None) -> str:
    st = read_status(figure_id, root)
    if st is None:
        return "not run"
    run = run_info(st)
    return f"{st['size']} run {run.get('finished', '?')} ({run.get('elapsed_s', 0):.0f} s)"


# -- publishing -----------------------------------------------------------------------------

RENDERED = ("comparison.csv", "comparison.md", "status.json")


def _product_files(folder: Path) -> list[Path]:
    """A run's files that a publication copies: its top-level data and plots (runs/,
    hidden and temporary files and the rendered comparison/status stay behind)."""
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name not in RENDERED
                  and not p.name.endswith(".tmp"))


def _write_if_changed(path: Path, data: bytes) -> bool:
    if path.exists() and path.read_bytes() == data:
        return False
    write_bytes(path, data)
    return True


def publish(figure_id: str, from_dir: Path, results_root: Path | None = None) -> list[Path]:
    """Copy a finished run of `figure_id` (its folder `from_dir`) into the published
    results <results_root>/<id>/: the data and plots, comparison.csv/.md without the
    published-value column, status.json. Each file is written only when its bytes
    differ, and status.json only when a product or the comparison changed (its "run"
    section alone, i.e. when and how long, does not count); files the run no longer makes
    are removed. Returns the paths written or removed."""
    fig = get(figure_id)
    status = read_status(figure_id, folder=from_dir)
    if status is None:
        raise FileNotFoundError(f"{from_dir} holds no status.json: run the figure first")
    rows = [Row(**{k: v for k, v in r.items() if k in Row.__dataclass_fields__})
            for r in status["rows"]]
    dest = (results_root or default_results_root()) / figure_id
    dest.mkdir(parents=True, exist_ok=True)
    changed: list[Path] = []
    products = _product_files(from_dir)
    for src in products:
        if _write_if_changed(dest / src.name, src.read_bytes()):
            changed.append(dest / src.name)
    keep = {p.name for p in products} | set(RENDERED)
    for old in _product_files(dest):
        if old.name not in keep:
            old.unlink()
            changed.append(old)
    for name, text in (("comparison.csv", comparison_csv_text(rows)),
                       ("comparison.md", comparison_markdown(fig, rows))):
        if _write_if_changed(dest / name, text.encode()):
            changed.append(dest / name)
    old_status = read_status(figure_id, folder=dest)
    if changed or old_status is None or _content(old_status) != _content(status):
        write_text(dest / "status.json", json.dumps(status, indent=1) + "\n")
        changed.append(dest / "status.json")
    return changed


# -- the results README ---------------------------------------------------------------------


def results_readme(root: Path | None = None) -> str:
    """results/README.md: every registered figure, its status and one-line verdict."""
    lines = [
        "# Results",
        "",
        "Generated by `repro figure --readme` (and by `repro figure ID --publish`) from each",
        "figure's status.json: do not edit.",
        "",
        "Each figure's folder holds its data (CSV), plot (PNG), comparison.csv/.md (paper",
        "value, reproduced value with its interval when timed, ratio, verdict, the rule that",
        "gave it, the cause of a row that does not hold, reason) and status.json. The papers'",
        "values are in reference/<paper>.csv (source: text, table or plot-estimate).",
        "Machine-specific micro-benchmarks are in bench/.",
        "",
        "Verdicts follow one rule table, in this order of precedence:",
        "",
        rules_markdown(),
        "",
        "Every row that does not hold names one cause, its specifics in the row's reason:",
        "",
        causes_markdown(),
        "",
        "| figure | paper | what | status | verdict |",
        "|---|---|---|---|---|",
    ]
    for fid in registered():
        fig = get(fid)
        st = read_status(fid, root)
        verdict_text = st["summary"] if st else "—"
        lines.append(f"| [{fid}]({fid}/comparison.md) | {fig.paper} | {fig.title} | "
                     f"{status_line(fid, root)} | {verdict_text} |")
    long_root = published_root(root, "long")
    lines += [
        "",
        "## The extended set (long training runs)",
        "",
        "`scripts/repro_figure.sh --set extended` runs the training figures' long variants,",
        "long enough (at least a tenth of the paper's steps) for the convergence claims to be",
        "judged on the stand-ins; published in long/<figure>/.",
        "",
        "| figure | status | verdict |",
        "|---|---|---|",
    ]
    for fid in extended_set():
        st = read_status(fid, long_root)
        lines.append(f"| [{fid}](long/{fid}/comparison.md) | {status_line(fid, long_root)} | "
                     f"{st['summary'] if st else '—'} |")
    return "\n".join(lines) + "\n"


def write_results_readme(root: Path | None = None) -> Path:
    """Regenerate <root>/README.md (the published results), only when its text changes."""
    root = root or default_results_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / "README.md"
    _write_if_changed(path, results_readme(root).encode())
    return path

