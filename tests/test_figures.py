"""Every registered paper figure, through the whole pipeline at size=smoke (seconds each),
plus the pipeline's own checks. A figure added to repro/figures/ is tested here for free:
it must run, write a PNG, a data CSV and a comparison whose verdicts are computed."""

from __future__ import annotations

import ast
import csv
import json
from pathlib import Path

import pytest

from repro import figures
from repro.figures import base

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


@pytest.mark.parametrize("fid", IDS)
def test_smoke_variant_runs_end_to_end(fid, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    rows = base.run_figure(fid, size="smoke", out_root=tmp_path, say=lambda m: None)
    out = tmp_path / fid
    assert rows and all(r.verdict in base.VERDICTS and r.reason for r in rows)
    assert list(out.glob("*.png")), "no plot written"
    data = [p for p in out.glob("*.csv") if p.name != "comparison.csv"]
    assert data, "no data CSV written"
    with open(out / "comparison.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    status = json.loads((out / "status.json").read_text())
    assert status["size"] == "smoke" and status["id"] == fid


def test_unknown_figure_names_the_known_ones():
    with pytest.raises(KeyError, match="known figures"):
        base.run_figure("sidco-fig999", size="smoke")


def test_bad_size_is_refused_before_work(tmp_path):
    with pytest.raises(ValueError, match="size"):
        base.run_figure("anything", size="huge", out_root=tmp_path)


def test_row_ratio_and_verdict_validation():
    r = base.Row("s", "m", 2.0, 3.0, "holds", "because")
    assert r.ratio == pytest.approx(1.5)
    assert base.Row("s", "m", None, 3.0, "not comparable", "no paper value").ratio is None
    with pytest.raises(ValueError, match="verdict"):
        base.Row("s", "m", 1.0, 1.0, "maybe", "x")
    assert base.verdict(True) == "holds" and base.verdict(False) == "does not hold"
    assert base.verdict(None) == "not comparable"


def test_results_readme_lists_every_figure_with_status(tmp_path):
    text = base.results_readme(tmp_path)
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
    """Figure modules share helpers only through base.py and common.py: a figure module
    that imports another would tie one paper's figures to another's."""
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
