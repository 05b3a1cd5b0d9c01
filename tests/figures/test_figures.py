"""Every registered paper figure, through the whole pipeline at size=smoke (seconds each),
plus the pipeline's own checks. A figure added to repro/figures/ is tested here for free:
it must run, write a PNG, a data CSV and a comparison whose verdicts are computed."""

from __future__ import annotations

import ast
import csv
import io
import json
import shutil
from pathlib import Path

import pytest

from repro import figures
from repro.figures import base, machine, records, registry, verdicts

figures.load_all()
IDS = figures.registered()

REQUIRED_IDS = {
    "sidco-fig1", "sidco-fig3", "sidco-fig5", "sidco-fig9", "sidco-fig16",
    "dragonn-fig1b", "dragonn-fig5a", "dragonn-fig5b", "dragonn-table2", "dragonn-lemmaA10",
    "dragonn-fig7",
    "deft-fig1", "deft-fig3", "deft-fig4", "deft-fig5", "deft-fig7", "deft-fig9", "deft-fig10",
    "thc-fig2b", "thc-fig4", "thc-fig8", "thc-fig9", "thc-fig10",
}


def test_every_required_figure_is_registered():
    assert REQUIRED_IDS <= set(IDS), f"missing figures: {sorted(REQUIRED_IDS - set(IDS))}"


def test_default_set_is_registered():
    assert set(figures.DEFAULT_SET) <= set(IDS)


@pytest.mark.parametrize("fid", IDS)
def test_experiment_file_has_the_header(fid):
    fig = figures.get(fid)
    header = base.experiment_header(fig.experiment or fid)
    assert set(base.EXPERIMENT_HEADER_FIELDS) <= set(header), header
    assert fid in header["command"]


@pytest.mark.parametrize("fid", IDS)
def test_reference_values_exist_and_are_well_formed(fid):
    fig = figures.get(fid)
    rows = [r for r in base.read_reference(fig.paper) if r["figure"] == fid]
    assert rows, f"no reference values for {fid} in results/reference/{fig.paper}.csv"


# Every figure's whole pipeline, its runs trained (30-40 s for all of them on two cores): in
# the heavy lane, which CI runs after the default one.
@pytest.mark.heavy
@pytest.mark.parametrize("fid", IDS)
def test_smoke_variant_runs_end_to_end(fid, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    rows = base.run_figure(fid, size="smoke", out_root=tmp_path, say=lambda m: None,
                           results_root=tmp_path / "no-results", calibrate=False)
    out = tmp_path / fid
    assert rows and all(r.verdict in verdicts.VERDICTS and r.reason for r in rows)
    for r in rows:  # every verdict comes from the rule table, and says which rule
        assert r.rule in verdicts.RULE_NAMES and r.reason.startswith(f"[rule: {r.rule}]")
        if r.interval is not None:
            assert r.low <= r.high
    assert list(out.glob("*.png")), "no plot written"
    data = [p for p in out.glob("*.csv") if p.name != "comparison.csv"]
    assert data, "no data CSV written"
    with open(out / "comparison.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    status = json.loads((out / "status.json").read_text())
    assert status["size"] == "smoke" and status["id"] == fid
    assert status["run"]["elapsed_s"] >= 0 and status["run"]["machine"]["kind"]
    assert sum(status["verdicts"].values()) == len(rows)
    # Run folders stay small: what the figure needs, no cached gradients.
    runs = out / "runs"
    size = sum(p.stat().st_size for p in runs.rglob("*") if p.is_file()) if runs.exists() else 0
    assert size < 20 * 2**20, f"{fid}: {size / 2**20:.1f} MB under runs/"


def test_unknown_figure_names_the_known_ones():
    with pytest.raises(KeyError, match="known figures"):
        base.run_figure("sidco-fig999", size="smoke")


def test_bad_size_is_refused_before_work(tmp_path):
    with pytest.raises(ValueError, match="size"):
        base.run_figure("anything", size="huge", out_root=tmp_path)


def test_results_readme_lists_every_figure_with_status(tmp_path):
    text = records.results_readme(tmp_path)
    for fid in IDS:
        assert f"[{fid}]" in text
    assert "not run" in text or not IDS


def _figure_package_imports(path: Path) -> set[str]:
    """The modules of repro.figures that a source file imports, anywhere in it (module
    level or inside functions), in any spelling: `import repro.figures.x`, `from
    repro.figures.x import ...`, `from repro.figures import x`, `from .x import ...`,
    `from . import x`."""
    package = "repro.figures"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(package + "."):
                    found.add(alias.name.split(".")[2])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against repro.figures
                module = package + ("." + module if module else "")
            if module == package:
                found.update(alias.name for alias in node.names)
            elif module.startswith(package + "."):
                found.add(module.split(".")[2])
    return found


def test_no_figure_module_imports_another():
    """Figure modules share helpers only through the shared modules (figures.SHARED_MODULES):
    a figure module that imports another would tie one paper's figures to another's."""
    folder = Path(figures.__file__).parent
    modules = {p.stem: p for p in folder.glob("*.py") if p.stem != "__init__"}
    paper_modules = set(modules) - set(figures.SHARED_MODULES)
    assert {"sidco", "dragonn", "deft", "thc"} <= paper_modules
    for name, path in sorted(modules.items()):
        imported = _figure_package_imports(path) - {name}
        wrong = imported & paper_modules
        assert not wrong, f"repro/figures/{path.name} imports figure module(s) {sorted(wrong)}"
        assert imported <= set(figures.SHARED_MODULES), (name, imported)


def test_the_import_walk_sees_every_spelling(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "import repro.figures.deft\n"
        "from repro.figures.thc import x\n"
        "from repro.figures import sidco, base\n"
        "def f():\n"
        "    from .dragonn import y\n"
        "    from . import common\n")
    assert _figure_package_imports(source) == {"deft", "thc", "sidco", "base", "dragonn",
                                               "common"}


# The shared modules in layers, each importing only from those below it: the verdict rules
# at the bottom, depending on nothing of the package.
LAYERS = ("verdicts", "registry", "records", "machine", "base", "common")


def test_the_shared_modules_are_layered_with_the_verdict_rules_at_the_bottom():
    assert set(LAYERS) == set(figures.SHARED_MODULES)
    folder = Path(figures.__file__).parent
    for i, name in enumerate(LAYERS):
        imported = _figure_package_imports(folder / f"{name}.py") - {name}
        assert imported <= set(LAYERS[:i]), (name, sorted(imported - set(LAYERS[:i])))


# -- where a run writes, publishing, progress ----------------------------------------------------

DETERMINISTIC = "dragonn-lemmaA10"  # seeded: the same data, plot and rows every run


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _published_copy(tmp_path: Path, *ids: str) -> Path:
    """A copy of the published results (reference values, README, the given figures)."""
    src = registry.default_results_root()
    dst = tmp_path / "results"
    shutil.copytree(src / "reference", dst / "reference")
    shutil.copy(src / "README.md", dst / "README.md")
    for fid in ids:
        if (src / fid).exists():
            shutil.copytree(src / fid, dst / fid, ignore=shutil.ignore_patterns("runs"))
    return dst


@pytest.mark.slow
def test_a_run_writes_no_tracked_file_without_publish(tmp_path, monkeypatch, capsys):
    """`repro figure` (here the smoke variant, as CI runs it) writes its outputs only,
    leaving the published results untouched byte for byte."""
    from repro.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    results = _published_copy(tmp_path, DETERMINISTIC, "thc-fig10")
    monkeypatch.setenv("GRADCOMP_RESULTS", str(results))
    outputs = tmp_path / "outputs"
    monkeypatch.setenv("GRADCOMP_OUTPUTS", str(outputs))
    before = _snapshot(results)
    assert main(["figure", DETERMINISTIC, "thc-fig10", "--size", "smoke"]) == 0
    capsys.readouterr()
    assert _snapshot(results) == before
    for fid in (DETERMINISTIC, "thc-fig10"):  # the default smoke outputs: outputs/smoke/<id>
        assert (outputs / "smoke" / fid / "comparison.md").exists()
        assert (outputs / "smoke" / fid / "status.json").exists()


@pytest.mark.slow
def test_publish_writes_only_what_changed_and_shows_published_beside_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    results = tmp_path / "results"
    shutil.copytree(registry.default_results_root() / "reference", results / "reference")
    out = tmp_path / "out"
    lines: list[str] = []
    base.run_figure(DETERMINISTIC, size="smoke", out_root=out, say=lines.append,
                    results_root=results, publish_to=results, calibrate=False)
    published = results / DETERMINISTIC
    names = sorted(p.name for p in published.iterdir())
    assert {"comparison.csv", "comparison.md", "status.json", "figure.png"} <= set(names)
    assert "runs" not in names  # run folders are never published
    first = _snapshot(published)
    assert "| published |" not in (published / "comparison.md").read_text()

    # The same figure again: bit-identical data, so no published file is rewritten (the
    # new elapsed time and timestamp stay in the run's own status.json).
    lines.clear()
    base.run_figure(DETERMINISTIC, size="smoke", out_root=out, say=lines.append,
                    results_root=results, publish_to=results, calibrate=False)
    assert _snapshot(published) == first
    assert any("nothing changed" in line for line in lines)
    # ... and this run's comparison puts the published value and verdict beside its own.
    table = (out / DETERMINISTIC / "comparison.md").read_text()
    assert "| published |" in table
    with open(out / DETERMINISTIC / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["published_verdict"] == r["verdict"] for r in rows)
    assert any("rows with the same verdict" in line for line in lines)

    # A changed product is published, with a new status.json.
    (out / DETERMINISTIC / "empty_ratio.csv").write_text("changed\n")
    written = records.publish(DETERMINISTIC, out / DETERMINISTIC, results)
    assert {p.name for p in written} == {"empty_ratio.csv", "status.json"}


def test_the_comparison_has_a_cause_column(tmp_path):
    fig = registry.Figure("x-fig", "sidco", "t", "benchmark", "hw", "claim", {"smoke": 1, "full": 1},
                      lambda ctx: [])
    rows = [verdicts.judge("a", "m", None, 0.5, claim="c", holds=False,
                       cause="refuted: the paper's own setting"),
            verdicts.judge("b", "m", None, 2.0, claim="c", holds=True, cause="scale: small")]
    table = list(csv.DictReader(io.StringIO(records.comparison_csv_text(rows))))
    assert [r["cause"] for r in table] == ["refuted", ""]
    assert [r["verdict"] for r in table] == ["does not hold", "holds"]
    md = records.comparison_markdown(fig, rows).splitlines()
    head = next(line for line in md if line.startswith("| setting"))
    cells = [c.strip() for c in head.strip("|").split("|")]
    first = next(line for line in md if line.startswith("| a |"))
    values = [c.strip() for c in first.strip("|").split("|")]
    assert values[cells.index("cause")] == "refuted"
    assert values[cells.index("verdict")] == "does not hold"
    assert "1 does not hold (1 refuted)" in records.summary_verdict(rows)
    assert records.status_of(fig, "full", rows, {})["causes"] == {"refuted": 1}


def test_publish_refuses_a_smoke_run_on_the_command_line(capsys):
    from repro.cli import main

    assert main(["figure", DETERMINISTIC, "--size", "smoke", "--publish"]) != 0
    assert "--publish" in capsys.readouterr().err


def _fake_figure(fid: str, seconds: float) -> registry.Figure:
    def produce(ctx):
        return [verdicts.judge("s", "m", 1.0, 1.0, claim="c", holds=True)]

    return registry.Figure(fid, "thc", "a test figure", "analysis", "none", "claim",
                       {"smoke": seconds, "full": seconds}, produce)


def test_progress_lines_count_figures_with_estimates_and_elapsed_time(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._FIGURES, "zz-test-a", _fake_figure("zz-test-a", 30))
    monkeypatch.setitem(registry._FIGURES, "zz-test-b", _fake_figure("zz-test-b", 12))
    ticks = iter([100.0, 100.0, 140.0, 150.0])
    lines: list[str] = []
    failed = base.run_figures(["zz-test-a", "zz-test-b"], size="smoke", out_root=tmp_path,
                              say=lines.append, results_root=tmp_path / "none",
                              clock=lambda: next(ticks))
    assert failed == []
    progress = [line for line in lines if line.startswith("figure ")]
    assert progress == ["figure 1/2: zz-test-a (estimated 30 s, 0 s elapsed, about 42 s to go)",
                        "figure 2/2: zz-test-b (estimated 12 s, 40 s elapsed, about 12 s to go)"]
    assert lines[-1] == "2 of 2 figure(s) done in 50 s"
    assert base.progress_line(3, 13, "sidco-fig16", 70.4, 212.2) == \
        "figure 3/13: sidco-fig16 (estimated 70 s, 212 s elapsed)"


def test_estimates_come_from_recorded_run_times_of_this_machine_kind(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._FIGURES, "zz-test-a", _fake_figure("zz-test-a", 30))
    assert machine.estimate_seconds("zz-test-a", "full", tmp_path, tmp_path / "r") == \
        (30.0, "built-in estimate")
    results = tmp_path / "r"
    (results / "zz-test-a").mkdir(parents=True)
    status = {"id": "zz-test-a", "size": "full",
              "run": {"elapsed_s": 55.0, "machine": {"kind": "another CPU"}}}
    (results / "zz-test-a" / "status.json").write_text(json.dumps(status))
    assert machine.estimate_seconds("zz-test-a", "full", tmp_path, results, kind="this CPU") == \
        (55.0, "published run, another machine")
    status["run"] = {"elapsed_s": 41.0, "machine": {"kind": "this CPU"}}
    (tmp_path / "zz-test-a").mkdir()
    (tmp_path / "zz-test-a" / "status.json").write_text(json.dumps(status))
    assert machine.estimate_seconds("zz-test-a", "full", tmp_path, results, kind="this CPU") == \
        (41.0, "this machine's last run, same machine kind")


def test_busy_machine_is_noticed():
    assert machine.busy_reasons([3.5, 2.0, 1.0], None, cpus=2) == ["load average 3.50 on 2 CPUs"]
    assert machine.busy_reasons([0.2, 0.2, 0.2], {"spread": 1.1}, cpus=2) == []
    noisy = {"spread": 3.0, "floor_p10_ms": 1.0, "floor_p90_ms": 3.0}
    assert "one-pass floor" in machine.busy_reasons([0.2, 0.2, 0.2], noisy, cpus=2)[0]


@pytest.mark.parametrize("argv, expected", [
    ([], ["--default"]),
    (["--size", "smoke"], ["--size", "smoke", "--default"]),
    (["sidco-fig16"], ["sidco-fig16"]),
    (["deft-fig3", "steps=400"], ["deft-fig3", "--override", "steps=400"]),
    (["--out", "/tmp/x", "--size", "smoke"], ["--out", "/tmp/x", "--size", "smoke", "--default"]),
    (["--list"], ["--list"]),
    (["--set", "extended"], ["--extended"]),
    (["--set", "default"], ["--default"]),
    (["deft-fig10", "--size", "long"], ["deft-fig10", "--size", "long"]),
])
def test_the_script_runs_the_default_set_when_no_figure_is_named(tmp_path, argv, expected):
    """scripts/repro_figure.sh: no figure id means the default set, also with options
    (CI runs `scripts/repro_figure.sh --size smoke`); KEY=VALUE become overrides."""
    import os
    import subprocess

    fake = tmp_path / "bin" / "repro"
    fake.parent.mkdir()
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    script = registry.repo_root() / "scripts" / "repro_figure.sh"
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(script), *argv], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == ["figure", *expected]


@pytest.mark.slow
def test_a_smoke_size_figure_shows_a_pipeline_check_not_verdicts(tmp_path):
    """At smoke size (a tiny run that checks a figure's pipeline) neither the console nor
    comparison.md states a verdict on the paper's claim: each row is a pipeline check, its
    rule's verdict labelled as not comparable."""
    figures.load_all()
    lines: list[str] = []
    rows = base.run_figure("dragonn-lemmaA10", size="smoke", out_root=tmp_path, calibrate=False,
                           say=lines.append)
    (final,) = [line for line in lines if line.startswith("dragonn-lemmaA10:")]
    assert final.startswith(f"dragonn-lemmaA10: pipeline check: {len(rows)} comparison rows "
                            "computed at smoke size")
    assert "holds" not in final and "does not hold" not in final
    (md,) = tmp_path.rglob("comparison.md")
    text = md.read_text()
    assert "Smoke size: a pipeline check" in text
    table = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")][1:]
    assert len(table) == len(rows)
    for cells, row in zip(table, rows):
        assert cells[5] == f"pipeline check (smoke size, not comparable: {row.verdict})"
