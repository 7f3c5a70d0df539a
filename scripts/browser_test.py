"""Open every notebook in JupyterLab in headless Chromium, as a person would, and check what it shows.

    python scripts/browser_test.py [NOTEBOOK.ipynb ...]      (default: notebooks/*.ipynb, then notebooks/appendix/; `make test-browser`)

JupyterLab runs from this interpreter's environment with its defaults (as `make lab` starts it), on a
free port, on copies of the notebooks in a temporary folder. Per notebook it fails when:
* the notebook shows the unsaved-changes dot after it opened and its kernel started, or saving it then
  changes its bytes (scripts/normalize_notebooks.py must store what JupyterLab writes);
* before or after running, an output shows a widget as text ("HBox(children=...", "Output()");
* after Run > Run All Cells, a cell raised or did not run;
* an explorer (a cell output with controls) has fewer than two controls to change, a label or button
  text is cut, a figure is wider than the notebook column, or, after a control is changed and again
  after it is changed back, the output did not change, a figure is missing or blank (one colour), or
  the explorer shows an error.
Needs `chromium` and `chromedriver` (Debian: chromium, chromium-driver) and selenium.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

try:
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select
except ImportError:                          # the checks on snapshots below are tested without a browser
    webdriver = None

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CHROME_FLAGS = ("--headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage --disable-background-networking "
                "--no-first-run --disable-component-update --disable-sync --window-size=1366,900").split()
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_TEXT = ("HBox(children=", "VBox(children=", "Output()")
CONTROLS = ".widget-dropdown, .widget-hslider, .widget-toggle-buttons, .widget-checkbox"
MIN_INK = 0.005                  # a figure with less than this share of pixels off its background is blank
RUN_TIMEOUT, REDRAW_TIMEOUT = 900, 90

# One explorer's output as the page shows it: text without the controls, and every image: loaded,
# its size, a fingerprint of its pixels and its share of pixels that differ from the corner pixel.
SNAPSHOT_JS = """
const area = arguments[0], controls = arguments[1];
const clone = area.cloneNode(true);
clone.querySelectorAll(controls + ', .widget-label').forEach(e => e.remove());
const imgs = [...area.querySelectorAll('img')].map(img => {
  if (!img.complete || !img.naturalWidth) return {loaded: false};
  const c = document.createElement('canvas'); c.width = 96; c.height = 96;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0, 96, 96);
  const px = g.getImageData(0, 0, 96, 96).data; let ink = 0, sum = 0;
  for (let i = 0; i < px.length; i += 4) {
    const d = Math.abs(px[i] - px[0]) + Math.abs(px[i + 1] - px[1]) + Math.abs(px[i + 2] - px[2]);
    if (d > 24) ink++; sum = (sum * 31 + px[i] + 3 * px[i + 1] + 7 * px[i + 2]) % 1000000007;
  }
  const out = img.closest('.jp-OutputArea-output').getBoundingClientRect(), box = img.getBoundingClientRect();
  return {loaded: true, w: img.naturalWidth, h: img.naturalHeight, over: Math.max(0, box.right - out.right),
          ink: ink / (px.length / 4), hash: img.naturalWidth + 'x' + img.naturalHeight + ':' + sum};
});
return {text: clone.textContent.trim(), imgs: imgs,
        sideways: [...area.querySelectorAll('.jp-OutputArea-output, .widget-box')]
                    .filter(e => e.scrollWidth > e.clientWidth + 1).length,
        busy: !!area.querySelector('.moelora-explorer-busy'), error: !!area.querySelector('.moelora-explorer-error'),
        cut: [...area.querySelectorAll('.widget-label, .widget-toggle-button')]
               .filter(e => e.offsetWidth && e.scrollWidth > e.clientWidth + 1).map(e => e.innerText)};
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(folder: Path, port: int, token: str) -> subprocess.Popen:
    """JupyterLab as `make lab` starts it, on ``folder``, with its own settings and workspaces."""
    settings = folder / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", JUPYTERLAB_SETTINGS_DIR=str(folder / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(folder / "workspaces"))
    cmd = [str(BIN / "jupyter"), "lab", f"--notebook-dir={folder / 'notebooks'}", f"--port={port}", "--no-browser",
           "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}"]
    cmd += ["--allow-root"] if os.getuid() == 0 else []
    lab = subprocess.Popen(cmd, env=env, stdout=open(folder / "lab.log", "w"), stderr=subprocess.STDOUT,
                           start_new_session=True)
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
            return lab
        except OSError:
            if lab.poll() is not None:
                break
            time.sleep(0.5)
    raise RuntimeError("JupyterLab did not start; its log:\n" + (folder / "lab.log").read_text()[-3000:])


def start_browser(profile: Path) -> webdriver.Chrome:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        raise SystemExit("chromium and chromedriver are needed (Debian: apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    for flag in CHROME_FLAGS + [f"--user-data-dir={profile}"]:
        opts.add_argument(flag)
    opts.binary_location = chromium
    opts.set_capability("unhandledPromptBehavior", "accept")
    return webdriver.Chrome(options=opts, service=Service(driver))


def wait(what: str, condition, timeout: float, poll: float = 0.3):
    end = time.time() + timeout
    while time.time() < end:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def kernel_idle(d) -> bool:
    """The current notebook's kernel has started, answered, and runs nothing (toolbar and status bar)."""
    return d.execute_script("const e = document.querySelector('.jp-Notebook-ExecutionIndicator');"
                            "const bar = document.querySelector('#jp-main-statusbar');"
                            "return !!e && e.getAttribute('data-status') === 'idle' && !!bar && "
                            "/\\| Idle/.test(bar.textContent);")


def save(d, path: Path) -> None:
    before = path.stat().st_mtime_ns
    d.find_element(By.CSS_SELECTOR, ".jp-NotebookPanel-notebook").send_keys(Keys.CONTROL, "s")
    wait(f"{path.name} to be saved", lambda: path.stat().st_mtime_ns != before, 30)
    time.sleep(0.5)


def attach_all(d, cells: int) -> None:
    """Scroll through the notebook until JupyterLab has attached all ``cells`` (it attaches them lazily)."""
    def attached():
        d.execute_script("const o = document.querySelector('.jp-mod-current .jp-WindowedPanel-outer') || "
                         "document.querySelector('.jp-WindowedPanel-outer'); o.scrollTop += o.clientHeight;")
        return len(d.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel-notebook .jp-Cell")) >= cells

    wait(f"all {cells} cells to be attached", attached, 60, 0.2)


def widget_text(d) -> list[str]:
    outs = d.execute_script("return [...document.querySelectorAll('.jp-OutputArea-output')].map(e => e.textContent)")
    return [t[:60] for t in outs if any(w in t for w in WIDGET_TEXT)]


def run_all(d) -> None:
    d.find_element(By.XPATH, "//li[contains(@class,'lm-MenuBar-item')][.//div[text()='Run']]").click()
    d.find_element(By.XPATH, "//li[contains(@class,'lm-Menu-item')][.//div[text()='Run All Cells']]").click()
    prompts = lambda: d.execute_script("return [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
                                       ".map(e => e.textContent)")
    wait("the cells to start", lambda: any("*" in p for p in prompts()), 30, 0.1)
    wait("every cell to finish", lambda: kernel_idle(d) and not any("*" in p for p in prompts()), RUN_TIMEOUT, 1)


def controls_of(area) -> list:
    return [c for c in area.find_elements(By.CSS_SELECTOR, CONTROLS) if c.is_displayed()]


def change(d, control, back=None):
    """Move one control to another value (or back to ``back``); returns (its label, how to move it back),
    or None when the control is disabled."""
    kind = control.get_attribute("class")
    label = control.text.split("\n")[0] or kind
    if "widget-dropdown" in kind:
        sel = Select(control.find_element(By.TAG_NAME, "select"))
        if not sel._el.is_enabled():
            return None
        old = [o.get_attribute("index") for o in sel.options if o.is_selected()][0]
        sel.select_by_index(int(back if back is not None else (int(old) + 1) % len(sel.options)))
        return label, old
    if "widget-hslider" in kind:
        handle = control.find_element(By.CSS_SELECTOR, ".noUi-handle")
        if control.find_elements(By.CSS_SELECTOR, "[disabled]"):
            return None
        key = back or (Keys.ARROW_LEFT if handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
                       else Keys.ARROW_RIGHT)
        handle.send_keys(key)
        return label, Keys.ARROW_RIGHT if key == Keys.ARROW_LEFT else Keys.ARROW_LEFT
    if "widget-toggle-buttons" in kind:
        buttons = control.find_elements(By.CSS_SELECTOR, ".widget-toggle-button")
        if not all(b.is_enabled() for b in buttons):
            return None
        old = next(i for i, b in enumerate(buttons) if "mod-active" in b.get_attribute("class"))
        buttons[back if back is not None else (old + 1) % len(buttons)].click()
        return label, old
    box = control.find_element(By.CSS_SELECTOR, "input[type=checkbox]")
    if not box.is_enabled():
        return None
    box.click()
    return label, True


def redrawn(d, area, before: dict) -> dict:
    """Wait for the output to change from ``before`` and settle: two equal snapshots, nothing drawing."""
    snap = lambda: d.execute_script(SNAPSHOT_JS, area, CONTROLS)
    state = {"last": None}

    def settled():
        now = snap()
        ready = not now["busy"] and all(i["loaded"] for i in now["imgs"])
        done = ready and now != before and now == state["last"]
        state["last"] = now
        return now if done else None

    try:
        return wait("the output to change", settled, REDRAW_TIMEOUT, 0.4)
    except TimeoutError:
        return dict(state["last"] or snap(), unchanged=True)


def problems(snap: dict, before: dict) -> list[str]:
    found = []
    if snap.get("unchanged"):
        found.append("the output did not change")
    if snap["error"]:
        found.append("the explorer shows an error: " + snap["text"].split("\n")[0][:200])
    if before["imgs"] and not snap["imgs"]:
        found.append("the figure is gone (output now: " + repr(snap["text"][:120]) + ")")
    found += [f"figure {i + 1} is blank ({img['ink']:.2%} of its pixels drawn)"
              for i, img in enumerate(snap["imgs"]) if img["ink"] < MIN_INK]
    found += [f"figure {i + 1} reaches {img['over']:.0f} px past the notebook column"
              for i, img in enumerate(snap["imgs"]) if img["over"] > 1]
    found += ["the output scrolls sideways"] * bool(snap["sideways"])
    found += [f"label cut: {text!r}" for text in snap["cut"]]
    found += [f"a widget shows as text: {t!r}" for t in WIDGET_TEXT if t in snap["text"]]
    return found


PLOT_RANGES_JS = "const g = arguments[0]._fullLayout; return [g.xaxis.range, g.yaxis.range];"


def check_interactive(d, area) -> tuple[list[str], str]:
    """An interactive (plotly) view: hovering a bar shows its details with bytes and bandwidth, and a
    drag zooms along time only."""
    plots = area.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")
    if not plots:
        return [], ""
    plot, failures = plots[0], []
    d.execute_script("arguments[0].scrollIntoView({block: 'center'})", plot)
    bars = plot.find_elements(By.CSS_SELECTOR, "g.trace.bars path")
    if not bars:
        return ["the interactive view draws no bars"], ""
    ActionChains(d).move_to_element(bars[len(bars) // 2]).perform()
    try:
        hover = wait("a hover label", lambda: " | ".join(h.text.replace("\n", " ") for h in
                                                         plot.find_elements(By.CSS_SELECTOR, "g.hovertext")) or None,
                     10, 0.3)
        failures += [f"the hover label lacks {w!r}: {hover[:120]!r}" for w in ("duration", "TB/s") if w not in hover]
    except TimeoutError:
        failures.append("hovering a bar shows no label")
    (x0, y0) = d.execute_script(PLOT_RANGES_JS, plot)
    drag = plot.find_element(By.CSS_SELECTOR, "rect.nsewdrag")
    w = drag.size["width"]
    ActionChains(d).move_to_element_with_offset(drag, -w // 2 + 30, 0).click_and_hold() \
        .move_by_offset(w // 4, 5).release().perform()
    try:
        (x1, y1) = wait("the time axis to zoom", lambda: (r := d.execute_script(PLOT_RANGES_JS, plot))[0] != x0 and r,
                        10, 0.3)
        if y1 != y0:
            failures.append(f"zooming moved the rows too ({y0} -> {y1}); only time should zoom")
        zoom = f"zoom {x0[0]:.0f}–{x0[1]:.0f} -> {x1[0]:.0f}–{x1[1]:.0f} µs"
    except TimeoutError:
        failures.append("dragging along time did not zoom")
        zoom = "no zoom"
    d.execute_script("Plotly.relayout(arguments[0], {'xaxis.autorange': true})", plot)
    return failures, f"hover and {zoom}"


def check_explorers(d) -> tuple[list[str], list[str]]:
    areas = [a for a in d.find_elements(By.CSS_SELECTOR, ".jp-CodeCell .jp-OutputArea") if controls_of(a)]
    failures, notes = [], []
    for n, area in enumerate(areas, 1):
        d.execute_script("arguments[0].scrollIntoView()", area)
        snap = d.execute_script(SNAPSHOT_JS, area, CONTROLS)
        failures += [f"explorer {n}, as first drawn: {p}" for p in problems(snap, snap)]
        changed = 0
        for control in controls_of(area):
            moved = change(d, control)
            if moved is None:
                continue
            label, back = moved
            for step, undo in (("changed", None), ("changed back", back)):
                if undo is not None:
                    change(d, control, undo)
                after = redrawn(d, area, snap)
                failures += [f"explorer {n}, {label!r} {step}: {p}" for p in problems(after, snap)]
                snap = after
            changed += 1
        if changed < 2:
            failures.append(f"explorer {n}: only {changed} control(s) could be changed")
        found, checked = check_interactive(d, area)
        failures += [f"explorer {n}, interactive view: {p}" for p in found]
        if os.environ.get("BROWSER_TEST_SHOTS"):
            area.screenshot(str(Path(os.environ["BROWSER_TEST_SHOTS"]) / f"{d.title.split()[0]}-{n}.png"))
        notes.append(f"explorer {n}: {changed} controls changed and changed back, {2 * changed} redraws, "
                     f"{len(snap['imgs'])} figure(s) of {snap['imgs'][0]['w'] if snap['imgs'] else 0} px"
                     + (f", interactive view: {checked}" if checked else ""))
    return failures, notes


def check_notebook(d, base: str, folder: Path, where: Path, original: bytes) -> tuple[list[str], list[str]]:
    path = folder / where
    d.get(f"{base}/lab/tree/{where.relative_to('notebooks').as_posix()}?reset")
    wait("the notebook and its kernel", lambda: kernel_idle(d), 120)
    time.sleep(2)                            # the kernel's info reply may still rewrite the metadata
    failures, notes = [], []
    if d.find_elements(By.CSS_SELECTOR, ".lm-TabBar-tab.jp-mod-current.jp-mod-dirty"):
        failures.append("the unsaved-changes dot shows right after opening")
    save(d, path)
    if path.read_bytes() != original:
        old, new = json.loads(original), json.loads(path.read_bytes())
        what = [k for k in ("metadata", "nbformat", "nbformat_minor") if old[k] != new[k]]
        failures.append(f"JupyterLab rewrites it on open and save ({', '.join(what) or 'cells or formatting'} differ)")
    n_cells = len(json.loads(original)["cells"])
    attach_all(d, n_cells)
    failures += [f"before running, a widget shows as text: {t!r}" for t in widget_text(d)]
    hints = d.execute_script("return [...document.querySelectorAll('.jp-OutputArea-output')]"
                             ".filter(e => /run this cell/i.test(e.textContent)).length")
    notes.append(f"opened clean, {hints} run-this-cell hint(s)")
    t0 = time.time()
    run_all(d)
    save(d, path)
    attach_all(d, n_cells)
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    with_widgets = sum(any(WIDGET_VIEW in o.get("data", {}) for o in c["outputs"]) for c in cells)
    errors = [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]
    failures += [f"cell raised {o['ename']}: {o['evalue'][:200]}" for o in errors]
    failures += [f"{sum(c['execution_count'] is None for c in cells)} cell(s) did not run"] * any(
        c["execution_count"] is None for c in cells)
    failures += [f"after running, a widget shows as text: {t!r}" for t in widget_text(d)]
    notes.append(f"{len(cells)} code cells ran in {time.time() - t0:.0f} s, {len(errors)} errors")
    more, explored = check_explorers(d)
    if len(explored) != with_widgets:
        more.append(f"{with_widgets} cell(s) with widgets after running, {len(explored)} explorer(s) found on the page")
    if hints < len(explored):
        more.append(f"{len(explored)} explorer(s), {hints} run-this-cell hint(s) before running")
    return failures + more, notes + explored


def all_notebooks() -> list[Path]:
    """The lessons, then the appendix."""
    return sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "notebooks" / "appendix").glob("*.ipynb"))


def place(nb: Path) -> Path:
    """Where a notebook sits in the lab's folder: its path under notebooks/ (the appendix keeps its subfolder,
    so its links to the lessons resolve)."""
    parts = nb.parts
    return Path("notebooks", *parts[len(parts) - 1 - parts[::-1].index("notebooks") + 1:]) if "notebooks" in parts \
        else Path("notebooks", nb.name)


def main(paths: list[str]) -> int:
    if webdriver is None:
        raise SystemExit("selenium is needed: `make test-browser` installs it into .venv")
    notebooks = [Path(p).resolve() for p in paths] or all_notebooks()
    folder = Path(tempfile.mkdtemp(prefix="moelora-browser-"))
    for nb in notebooks:
        (folder / place(nb)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(nb, folder / place(nb))
    port, token, t_all, failed = free_port(), os.urandom(12).hex(), time.time(), 0
    lab = start_lab(folder, port, token)
    d = None
    try:
        d = start_browser(folder / "chromium")
        base = f"http://127.0.0.1:{port}"
        d.get(f"{base}/lab?token={token}")
        for nb in notebooks:
            t0 = time.time()
            try:
                failures, notes = check_notebook(d, base, folder, place(nb), nb.read_bytes())
            except (TimeoutError, WebDriverException) as exc:
                failures, notes = [f"{type(exc).__name__}: {str(exc).splitlines()[0]}"], []
            failed += bool(failures)
            print(f"{'FAIL' if failures else 'ok  '} {place(nb).relative_to('notebooks')}: {time.time() - t0:.0f} s; " + "; ".join(notes),
                  flush=True)
            for f in failures:
                print(f"       - {f}", flush=True)
            for session in json.load(urllib.request.urlopen(f"{base}/api/sessions?token={token}")):
                urllib.request.urlopen(urllib.request.Request(
                    f"{base}/api/sessions/{session['id']}?token={token}", method="DELETE"))
    finally:
        if d is not None:
            d.quit()
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(30)
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{len(notebooks)} notebook(s) in {time.time() - t_all:.0f} s")
    print(f"{len(notebooks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
