"""The `repro compare` page as a user sees it: three smoke trainings with long run names,
compared, rendered in headless Chromium at 1280x900. A screenshot is kept as the test's
output; a script injected into a copy of the page measures the layout after load and the
tests assert on what it finds: nothing wider than the window, long names wrapped, plots
whole and undistorted. Skips where no Chromium executable exists."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest

from repro import launch
from repro.cli import main

# Three trainings, a comparison and two headless Chromium runs, end to end (5-7 s here):
# in the heavy lane, which CI runs after the default one (with Chromium installed).
pytestmark = pytest.mark.heavy

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WIDTH, HEIGHT = 1280, 900
COMMON = ["cluster=simulated", "cluster.workers=1", "cluster.threads_per_worker=1",
          "task=cifar10_resnet20", "task.size=smoke", "steps=2", "eval_every=0", "eval_batches=1",
          "logger=local", "logger.progress=false"]
RUNS = {  # compressor -> run name (60+ characters, hyphens, underscores, none at all)
    "topk": "topk-ratio0.01-simulated-one-worker-cifar10_resnet20-smoke-long-name-for-wrapping",
    "dgc": "dgc_ratio0.01_simulated_one_worker_cifar10_resnet20_smoke_name_without_hyphens",
    "none": "densebaselinewithoutanyseparatorsatallcifar10resnet20smokerunnamethatmustwrap",
}
LONG = 60

MEASURE = """
<script>
window.addEventListener("load", () => {
  const doc = document.documentElement;
  const box = (el) => {
    const r = el.getBoundingClientRect();
    return {left: r.left + window.scrollX, right: r.right + window.scrollX,
            top: r.top + window.scrollY, bottom: r.bottom + window.scrollY,
            width: r.width, height: r.height};
  };
  const lines = (el) => {
    const range = document.createRange();
    range.selectNodeContents(el);
    const s = getComputedStyle(el);
    const lh = parseFloat(s.lineHeight) || 1.2 * parseFloat(s.fontSize);
    return Math.round(range.getBoundingClientRect().height / lh);
  };
  const clippers = (el) => {
    const out = [];
    for (let a = el.parentElement; a; a = a.parentElement) {
      const s = getComputedStyle(a);
      if (s.overflowX !== "visible" || s.overflowY !== "visible") {
        out.push({tag: a.tagName.toLowerCase() + (a.className ? "." + a.className : ""),
                  ...box(a)});
      }
    }
    return out;
  };
  const report = {
    inner_width: window.innerWidth,
    client_width: doc.clientWidth,
    scroll_width: doc.scrollWidth,
    body_scroll_width: document.body.scrollWidth,
    rows: [...document.querySelectorAll("tr")].map(tr => ({
      text: tr.textContent.trim().slice(0, 80), ...box(tr)})),
    long_cells: [...document.querySelectorAll("td, th")]
      .filter(c => c.textContent.trim().length >= LONG)
      .map(c => {
        const s = getComputedStyle(c);
        return {text: c.textContent.trim(), lines: lines(c), scroll_width: c.scrollWidth,
                client_width: c.clientWidth, word_break: s.wordBreak,
                overflow_wrap: s.overflowWrap, white_space: s.whiteSpace, ...box(c)};
      }),
    images: [...document.images].map(img => ({
      src: img.getAttribute("src"), complete: img.complete,
      natural_width: img.naturalWidth, natural_height: img.naturalHeight,
      clippers: clippers(img), ...box(img)})),
  };
  const out = document.createElement("pre");
  out.id = "layout-report";
  out.style.display = "none";
  out.textContent = JSON.stringify(report);
  document.body.appendChild(out);
});
</script>
""".replace("LONG", str(LONG))


def browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium(exe: str, profile, *args: str) -> str:
    cmd = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}",
           f"--window-size={WIDTH},{HEIGHT}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """(index.html, screenshot, layout report) of a real comparison."""
    exe = browser()
    if exe is None:
        pytest.skip(f"no Chromium executable ({', '.join(BROWSERS)}) on PATH; "
                    "install it with `apt-get install chromium`")
    root = tmp_path_factory.mktemp("compare_page")
    dirs = []
    for compressor, name in RUNS.items():
        dirs += launch.train([f"compressor={compressor}", f"name={name}", *COMMON,
                              f"runs_root={root / 'runs'}"], out=lambda s: None)
    out = root / "cmp"
    assert main(["compare", *dirs, "--out", str(out)]) == 0
    index = out / "index.html"
    text = index.read_text(encoding="utf-8")
    for name in RUNS.values():
        assert name in text

    shot = root / "compare-page.png"
    chromium(exe, root / "profile", f"--screenshot={shot}", index.as_uri())
    assert shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    print(f"compare page screenshot: {shot}")

    measured = out / "index.measure.html"  # beside index.html: the plots load by relative path
    measured.write_text(text.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    dom = chromium(exe, root / "profile", "--virtual-time-budget=10000", "--dump-dom",
                   measured.as_uri())
    found = re.search(r'<pre id="layout-report"[^>]*>(.*?)</pre>', dom, re.DOTALL)
    assert found, f"the layout script wrote no report; the DOM ends with:\n{dom[-1000:]}"
    return index, shot, json.loads(html.unescape(found.group(1)))


@pytest.fixture
def report(page, record_property):
    """The layout report; the screenshot's path goes into the test's report properties."""
    record_property("screenshot", str(page[1]))
    return page[2]


def test_the_page_has_no_horizontal_overflow(report):
    assert report["inner_width"] == WIDTH
    assert report["scroll_width"] <= report["client_width"], (
        f"the page is {report['scroll_width']} px wide in a {report['client_width']} px window")
    assert report["body_scroll_width"] <= report["client_width"]


def test_no_table_row_is_wider_than_the_page(report):
    assert len(report["rows"]) == 1 + len(RUNS)
    wide = [(r["text"], round(r["right"])) for r in report["rows"]
            if r["left"] < 0 or r["right"] > report["client_width"] + 0.5]
    assert not wide, f"rows past the {report['client_width']} px window (text, right edge): {wide}"


def test_long_run_names_wrap_inside_their_cells(report):
    cells = {c["text"]: c for c in report["long_cells"]}
    for name in RUNS.values():
        cell = cells[name]
        breaks = cell["word_break"] in ("break-all", "break-word") or \
            cell["overflow_wrap"] in ("anywhere", "break-word")
        assert cell["white_space"] not in ("nowrap", "pre"), (
            f"{name!r} cannot wrap: white-space is {cell['white_space']}")
        assert cell["scroll_width"] <= cell["client_width"], (
            f"{name!r} spills out of its cell ({cell['scroll_width']} > {cell['client_width']} px)")
        assert cell["lines"] > 1 or breaks, f"{name!r} is one line in a {cell['width']:.0f} px cell"


def test_plots_are_whole_and_undistorted(report):
    images = report["images"]
    assert len(images) >= 5
    for img in images:
        assert img["complete"] and img["natural_width"] > 0, f"{img['src']} did not load"
        assert img["left"] >= 0 and img["right"] <= report["client_width"] + 0.5, (
            f"{img['src']} spans x={img['left']:.0f}..{img['right']:.0f} in a "
            f"{report['client_width']} px page")
        for clip in img["clippers"]:
            inside = (clip["left"] - 0.5 <= img["left"] and img["right"] <= clip["right"] + 0.5
                      and clip["top"] - 0.5 <= img["top"] and img["bottom"] <= clip["bottom"] + 0.5)
            assert inside, f"{img['src']} is cut by its <{clip['tag']}>: {img} in {clip}"
        assert 0 < img["width"] <= img["natural_width"] + 0.5, f"{img['src']} is upscaled: {img}"
        natural = img["natural_height"] / img["natural_width"]
        assert img["height"] / img["width"] == pytest.approx(natural, rel=0.02), (
            f"{img['src']} is drawn {img['width']:.0f}x{img['height']:.0f}, "
            f"natural {img['natural_width']}x{img['natural_height']}")


def test_no_plot_has_its_title_or_legend_cut(page):
    """Each plot on the page keeps its titles, labels and legend inside the image: no ink
    on its outermost pixels (a cut title or legend runs into the edge)."""
    import matplotlib.image as mpimg
    import numpy as np

    folder = page[0].parent
    plots = sorted(folder.glob("*.png"))
    assert len(plots) >= 5
    for path in plots:
        image = mpimg.imread(path)[..., :3]
        edge = np.concatenate([image[:2].reshape(-1, 3), image[-2:].reshape(-1, 3),
                               image[:, :2].reshape(-1, 3), image[:, -2:].reshape(-1, 3)])
        assert int((edge.min(axis=1) < 0.9).sum()) == 0, f"{path.name} is cut at its edge"
