"""The run dashboard of ``posttrain view`` in a real headless Chromium driven by Selenium.

Skips only when Chromium itself is absent (as tests/diagnostics/test_viewer_browser.py); plotly comes
with the ``plot`` extra that ``make`` installs, so a missing plotly is a failure, not a skip. Each test
ends with no SEVERE entry in the browser's console log. The pages' screenshots (view_runs.png, view_run.png,
view_traj.png, view_compare.png) go to a temporary directory; ``POSTTRAIN_SCREENSHOTS=docs/img`` writes them
where docs/diagnostics.md shows them (how those were taken), so a test run does not rewrite tracked files.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.diagnostics.dashboard_data import MAX_POINTS
from posttrain.diagnostics.viewer_server import make_dashboard
from tests.diagnostics.synthetic import CONFIG, rl_metrics, step1, traj, write_outcomes, write_run


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the screenshots go: ``POSTTRAIN_SCREENSHOTS``, else a folder of pytest's own temporary tree (pruned by
    pytest with the rest; a ``mkdtemp`` of the system's /tmp was left behind by every run)."""
    env = os.environ.get("POSTTRAIN_SCREENSHOTS")
    path = Path(env) if env else tmp_path_factory.mktemp("view-shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A folder of runs: ``demo`` (finished, 20 steps, entropy collapse planted at step 12, ledger steps 1-2),
    ``crashed`` (failed before its first checkpoint) and ``sweep/seed1`` (finished, healthy)."""
    root = tmp_path / "runs"
    rows = rl_metrics(20, eval_every=5, entropy_collapse_at=12)
    rows[10].update(revision="rejected", revision_reason="held-out 0.450 < best 0.460")
    trajs = {
        1: step1(),
        2: [
            traj("q", "g9", "correct", 1.0, [-0.5, -0.25], [-0.5, -0.5]),
            traj("r", "g9", "wrong", 0.0, [-2.0], [-2.0], response="6"),
        ],
    }
    demo = write_run(
        root / "demo", metrics=rows, config={**CONFIG, "name": "grpo_demo", "steps": 20}, trajectories=trajs
    )
    write_outcomes(demo, rows, n_problems=60)
    (demo / "checkpoints" / "step_000020").mkdir(parents=True)
    (demo / "checkpoints" / "step_000020" / "meta.json").write_text("{}")
    write_run(root / "crashed", metrics=rl_metrics(3), config={**CONFIG, "name": "crashed", "steps": 20})
    seed = rl_metrics(20, eval_every=10, heldout_gain=0.4)
    write_outcomes(
        write_run(root / "sweep" / "seed1", metrics=seed, config={**CONFIG, "name": "rloo", "steps": 20}),
        seed,
        n_problems=60,
    )
    srv = make_dashboard(root, 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", root
    finally:
        srv.shutdown()
        srv.server_close()


def severe(browser: Any) -> list[Any]:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def wait_ready(browser: Any, timeout: float = 60) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, timeout, poll_frequency=0.05).until(
        lambda d: d.execute_script("return window.__posttrain && window.__posttrain.ready")
    )


def trace(browser: Any, panel: str, key: str) -> dict[str, Any]:
    return browser.execute_script(
        "const gd=document.getElementById(arguments[0]);if(!gd||!gd.data)return null;"
        "const t=gd.data.find(t=>t.meta===arguments[1]);return t?{x:Array.from(t.x),y:Array.from(t.y),"
        "step:Array.from(t.customdata)}:null",
        f"plot-{panel}",
        key,
    )


def test_runs_page_and_run_page_of_a_finished_run(runs: tuple[str, Path], browser: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    base, _ = runs
    wait = WebDriverWait(browser, 30)
    browser.get(base + "/")
    wait_ready(browser)
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.run")
    assert [r.get_attribute("data-id") for r in rows] == ["crashed", "demo", "sweep/seed1"]
    status = {r.get_attribute("data-id"): r.find_element(By.CSS_SELECTOR, ".status").text for r in rows}
    assert status == {"crashed": "failed", "demo": "finished", "sweep/seed1": "finished"}
    held = rows[1].find_element(By.CSS_SELECTOR, ".heldout").text
    assert held.startswith("heldout/accuracy 0.600 [") and "@ step 20 (n=60)" in held
    assert "grpo" in rows[1].text and "grpo_demo" in rows[1].text
    browser.save_screenshot(str(shots / "view_runs.png"))

    rows[1].find_element(By.TAG_NAME, "a").click()
    wait_ready(browser)
    wait.until(lambda d: trace(d, "heldout", "heldout/accuracy") is not None)
    reward = trace(browser, "reward", "reward/mean")
    assert reward["step"] == list(range(1, 21)) and reward["x"] == reward["step"]
    assert len(trace(browser, "heldout", "heldout/accuracy")["y"]) == 5  # steps 0, 5, 10, 15, 20
    assert len(trace(browser, "heldout", "heldout_sampled/accuracy")["y"]) == 5
    bands = browser.execute_script(
        "return document.getElementById('plot-heldout').data.filter(t=>t.fill==='toself').map(t=>t.x.length)"
    )
    assert bands == [10, 10]  # 5 evaluations, upper then lower edge, per held-out set
    panels = [e.get_attribute("id") for e in browser.find_elements(By.CSS_SELECTOR, ".panel")]
    assert panels[:4] == ["plot-reward", "plot-heldout", "plot-kl", "plot-entropy"] and "plot-time" in panels
    rejected = trace(browser, "heldout", "rejected")  # the rejected revision, marked on the held-out curve
    assert rejected["step"] == [10] and rejected["y"] == [pytest.approx(0.45)]
    wait.until(lambda d: "finished" in d.find_element(By.ID, "status").text)
    # the planted entropy collapse is marked on the entropy curve at the step it flags, with evidence, remedy
    sym = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".symptom[data-name='entropy collapse']"))
    step = int(sym[0].get_attribute("data-step"))
    assert (
        12 <= step <= 16
        and "entropy 0.9" in sym[0].text
        and "remedy: check the positive-advantage" in sym[0].text
    )
    ann = wait.until(
        lambda d: (
            d.execute_script(
                "return document.getElementById('plot-entropy').layout.annotations"
                ".map(a=>[a.text,a.x,a.hovertext])"
            )
            or None
        )
    )
    assert (
        len(ann) == 1 and "entropy collapse" in ann[0][0] and ann[0][1] == step and "Clip-Higher" in ann[0][2]
    )
    browser.save_screenshot(str(shots / "view_run.png"))

    # x axis: generated tokens (640 per step, cumulative), then wall time (1.6 s per step)
    Select(browser.find_element(By.ID, "xaxis")).select_by_value("tokens")
    wait.until(lambda d: trace(d, "reward", "reward/mean")["x"][:2] == [640, 1280])
    assert (
        browser.execute_script("return document.getElementById('plot-entropy').layout.annotations[0].x")
        == 640 * step
    )
    Select(browser.find_element(By.ID, "xaxis")).select_by_value("wall")
    wait.until(lambda d: abs(trace(d, "reward", "reward/mean")["x"][-1] - 32.0) < 1e-9)

    # config and checkpoints one click away
    browser.find_element(By.ID, "btn-config").click()
    assert "arithmetic" in wait.until(lambda d: d.find_element(By.ID, "config-text")).text
    assert "grpo" in browser.find_element(By.ID, "axes-table").text
    browser.find_element(By.ID, "btn-ckpt").click()
    ck = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "tr.ckpt"))
    assert "20" in ck[0].text and "promoted" in ck[0].text and "latest promoted" in ck[0].text
    assert severe(browser) == []


def test_click_on_a_point_opens_that_steps_trajectories(runs: tuple[str, Path], browser: Any, shots: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, _ = runs
    wait = WebDriverWait(browser, 30)
    browser.get(base + "/run/demo/")
    wait_ready(browser)
    gd = browser.find_element(By.ID, "plot-reward")
    # the pixel of the point of step 2 on the reward curve
    x, y = browser.execute_script(
        "const gd=arguments[0],fl=gd._fullLayout,t=gd.data.find(t=>t.meta==='reward/mean');"
        "return [fl.xaxis.l2p(t.x[1])+fl._size.l, fl.yaxis.l2p(t.y[1])+fl._size.t]",
        gd,
    )
    size = gd.size
    ActionChains(browser).move_to_element_with_offset(
        gd, int(x - size["width"] / 2), int(y - size["height"] / 2)
    ).pause(0.3).click().perform()
    wait.until(lambda d: "/run/demo/traj/" in d.current_url and "step=2" in d.current_url)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#step-2.sel"))
    wait.until(lambda d: "of 2 trajectories" in d.find_element(By.ID, "count").text)
    assert not browser.find_element(By.ID, "back").get_attribute("hidden")
    browser.find_elements(By.CSS_SELECTOR, ".traj")[0].click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".tok")) == 4)
    browser.save_screenshot(str(shots / "view_traj.png"))
    # a step without trajectories (the step-0 evaluation) opens the nearest step and says so
    browser.get(base + "/run/demo/traj/?step=0")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#step-1.sel"))
    wait.until(lambda d: "step 0 has no trajectories" in d.find_element(By.ID, "error").text)
    assert severe(browser) == []


def test_a_run_still_writing_gains_points_without_a_reload(runs: tuple[str, Path], browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, root = runs
    live = write_run(root / "live", metrics=rl_metrics(6), config={**CONFIG, "name": "live", "steps": 100})
    fd = os.open(live / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a writing run holds it
    try:
        browser.get(base + "/run/live/")
        wait_ready(browser)
        assert len(trace(browser, "reward", "reward/mean")["y"]) == 6
        WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "status").text == "running")
        browser.execute_script("window.__noReload = 42")
        with open(live / "metrics.jsonl", "a") as fh:  # a torn line first: not shown, not an error
            fh.write(json.dumps({"step": 7, "reward/mean": 0.95, "entropy": 0.5})[:15])
        time.sleep(2.5)
        assert (
            len(trace(browser, "reward", "reward/mean")["y"]) == 6
            and not browser.find_element(By.ID, "msg").text
        )
        with open(live / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"step": 7, "reward/mean": 0.95, "entropy": 0.5})[15:] + "\n")
        t0 = time.perf_counter()
        WebDriverWait(browser, 20, poll_frequency=0.1).until(
            lambda d: len(trace(d, "reward", "reward/mean")["y"]) == 7
        )
        print(f"new metrics line shown after {time.perf_counter() - t0:.2f} s (polling every 2 s)")
        assert trace(browser, "reward", "reward/mean")["y"][-1] == 0.95
        assert browser.execute_script("return window.__noReload") == 42  # the same page: no reload
    finally:
        os.close(fd)
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "status").text != "running")
    assert severe(browser) == []


def test_bad_metrics_show_a_message_never_a_blank_page(runs: tuple[str, Path], browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, root = runs
    wait = WebDriverWait(browser, 30)
    (root / "fresh").mkdir()
    (root / "fresh" / "config.yaml").write_text("name: fresh\nsteps: 5\n")  # nothing logged yet
    browser.get(base + "/run/fresh/")
    wait_ready(browser)
    wait.until(lambda d: "no complete line in metrics.jsonl yet" in d.find_element(By.ID, "note").text)
    broken = write_run(root / "broken", metrics=rl_metrics(4))
    text = (broken / "metrics.jsonl").read_text().splitlines()
    text.insert(2, '{"step": 2, "reward/me')  # a torn line in the middle (a crash, then a resume)
    (broken / "metrics.jsonl").write_text("\n".join(text) + '\n{"step": 5, "rew')  # and a torn last line
    browser.get(base + "/run/broken/")
    wait_ready(browser)
    assert trace(browser, "reward", "reward/mean")["step"] == [1, 2, 3, 4]
    assert (
        browser.find_element(By.ID, "note").text
        == "1 line(s) of metrics.jsonl could not be read and were skipped"
    )
    assert severe(browser) == []


def test_compare_overlays_two_runs(runs: tuple[str, Path], browser: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, _ = runs
    browser.get(base + "/")
    wait_ready(browser)
    for rid in ("demo", "sweep/seed1"):
        browser.find_element(By.CSS_SELECTOR, f"tr.run[data-id='{rid}'] .pick").click()
    browser.find_element(By.ID, "compare").click()
    WebDriverWait(browser, 30).until(lambda d: "/compare/?runs=demo,sweep%2Fseed1" in d.current_url)
    wait_ready(browser)
    lines = browser.execute_script(
        "return document.getElementById('cmp-heldout').data.filter(t=>t.meta).map(t=>[t.meta,t.x.length])"
    )
    assert lines == [["demo", 5], ["sweep", 3]]  # a run in a seed<k>/ folder counts for its recipe, "sweep"
    rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "tr.cmprow")]
    assert "(baseline)" in rows[0] and "0.600 @ step 20" in rows[0]
    assert rows[1].startswith("sweep rloo (sweep/seed1)") and "0.700 @ step 20" in rows[1]
    assert "+0.100 [+" in rows[1] and "over 60 problems" in rows[1]
    assert (
        browser.execute_script("return document.getElementById('cmp-reward').layout.shapes[0].x0") == 20 * 640
    )
    assert severe(browser) == []


def test_compare_shows_a_recipes_seeds_as_a_band(runs: tuple[str, Path], browser: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    base, root = runs
    ids = []
    for rec, name, gains in (("grpo", "grpo", (0.3, 0.38, 0.34)), ("rloo", "rloo", (0.42, 0.5, 0.46))):
        for seed, gain in enumerate(gains):
            rows = rl_metrics(
                40, eval_every=5, heldout_gain=gain, entropy_collapse_at=30 if rec == "grpo" else None
            )
            for m in rows:  # seeds differ in reward too
                if "reward/mean" in m:
                    m["reward/mean"] += 0.02 * seed * (m["step"] % 3)
            run = write_run(
                root / "cmp" / rec / f"seed{seed}",
                metrics=rows,
                config={**CONFIG, "name": name, "seed": seed, "steps": 40},
            )
            write_outcomes(run, rows, n_problems=80)
            ids.append(f"cmp/{rec}/seed{seed}")
    browser.get(base + "/compare/?runs=" + ",".join(ids))
    wait_ready(browser)
    lines = browser.execute_script(
        "return document.getElementById('cmp-heldout').data.filter(t=>t.meta).map(t=>[t.name,t.x.length])"
    )
    assert lines == [["cmp/grpo (3 seeds)", 9], ["cmp/rloo (3 seeds)", 9]]
    assert (
        browser.execute_script("return document.getElementById('cmp-reward').data.filter(t=>t.fill).length")
        == 2
    )
    rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "tr.cmprow")]
    assert (
        "mean of 3 seeds" in rows[0]
        and "x 3 seeds pooled" in rows[1]
        and "(paired t over 3 seeds)" in rows[1]
    )
    browser.save_screenshot(str(shots / "view_compare.png"))
    assert severe(browser) == []


def test_a_2000_step_run_page_loads_fast(tmp_path: Path, browser: Any) -> None:
    rows = rl_metrics(2000, eval_every=20)
    run = write_run(tmp_path / "long", metrics=rows, config={**CONFIG, "name": "long", "steps": 2000})
    write_outcomes(run, rows, n_problems=300)
    srv = make_dashboard(run, 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t0 = time.perf_counter()
        browser.get(f"http://127.0.0.1:{srv.server_address[1]}/run/@/")
        wait_ready(browser, timeout=120)
        seconds = time.perf_counter() - t0
        print(f"2000-step run page: curves drawn {seconds:.2f} s after the request")
        assert len(trace(browser, "reward", "reward/mean")["y"]) == MAX_POINTS
        assert len(trace(browser, "heldout", "heldout/accuracy")["y"]) == 101
        assert seconds < 60, f"2000-step run page took {seconds:.1f} s"
        assert severe(browser) == []
    finally:
        srv.shutdown()
        srv.server_close()
