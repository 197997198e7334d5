"""``posttrain view`` in a real headless Chromium driven by Selenium.

Skips only when Chromium itself is absent (CI installs ``chromium`` and ``chromium-driver``);
selenium comes with the ``dev`` extra, so a missing selenium is a failure, not a skip.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from posttrain.diagnostics.second_verifier import load_verifier
from posttrain.diagnostics.viewer_server import make_server
from tests.diagnostics.synthetic import step1, traj, write_run


def test_browse_colour_hover_filter_flagged(tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    trajs = {1: step1(), 2: [traj("q", "g9", "correct", 1.0, [-0.5, -0.25], [-0.5, -0.5], response="07",
                                  reference="7"), traj("r", "g9", "wrong", 0.0, [-2.0], [-2.0], response="6")]}
    srv = make_server(write_run(tmp_path / "run", trajectories=trajs), 0, load_verifier("exact"))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    wait = WebDriverWait(browser, 30)
    try:
        browser.get(f"http://127.0.0.1:{srv.server_address[1]}/")
        steps = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".step"))
        assert [s.text.split(" (")[0] for s in steps] == ["step 1", "step 2"]

        # The flagged list: integer@1 passed "07", exact@1 fails it; clicking opens the trajectory.
        item = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".flagitem"))
        assert len(item) == 1 and "step 2 q" in item[0].text
        assert "1 fail exact@1" in browser.find_element(By.ID, "flag-expl").text
        item[0].click()
        toks = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".tok"))
        assert len(toks) == 4
        hover = toks[3].get_attribute("title")  # the second action token
        assert "behaviour -0.2500" in hover and "old -0.5000" in hover and "ref -" in hover and "current -" in hover

        # Colour by log kappa: the action token with kappa 0 is near-transparent, the other is not.
        Select(browser.find_element(By.ID, "colour")).select_by_value("log_kappa")
        toks = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".tok"))
        assert "log kappa" in browser.find_element(By.ID, "legend").text
        assert "0.1)" in toks[2].value_of_css_property("background-color")  # |0| / scale -> alpha 0.1
        assert "0.9)" in toks[3].value_of_css_property("background-color")  # |-0.25| is the scale -> 0.9
        assert "log_rho" in browser.find_element(By.ID, "missing").text

        # Filters: step 1 has four trajectories, three wrong, two of them of length >= 3.
        browser.find_element(By.ID, "step-1").click()
        wait.until(lambda d: "of 4" in d.find_element(By.ID, "count").text)
        browser.find_element(By.ID, "f-status").send_keys("wrong")
        browser.find_element(By.ID, "f-len-min").send_keys("3")
        browser.find_element(By.ID, "apply").click()
        wait.until(lambda d: d.find_element(By.ID, "count").text.startswith("2 of 4"))
        assert len(browser.find_elements(By.CSS_SELECTOR, ".traj")) == 2
        browser.save_screenshot(str(tmp_path / "viewer.png"))
        assert (tmp_path / "viewer.png").stat().st_size > 0
    finally:
        srv.shutdown()
        srv.server_close()


def test_recorded_current_advantage_and_hidden_verdicts_in_the_browser(tmp_path: Path, browser: Any) -> None:
    """Issue 15: hover shows the recorded current log-prob, the header the stored advantage
    (``ledger``, not recomputed), and the flagged list comes from the ledger's hidden verdicts with
    no ``--verifier``."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from tests.diagnostics.test_recorded_fields import recorded_step

    srv = make_server(write_run(tmp_path / "run", trajectories={1: recorded_step()}), 0, None)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    wait = WebDriverWait(browser, 30)
    try:
        browser.get(f"http://127.0.0.1:{srv.server_address[1]}/")
        item = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".flagitem"))
        assert len(item) == 1 and "step 1 a" in item[0].text and "wrong" in item[0].text
        assert "1 fail strict@1" in browser.find_element(By.ID, "flag-expl").text
        item[0].click()
        toks = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".tok"))
        hover = toks[3].get_attribute("title")
        assert "old -1.2500" in hover and "current -1.0000" in hover and "advantage 0.7000" in hover
        assert browser.find_element(By.ID, "adv-src").text == "(ledger)"
        assert browser.find_element(By.ID, "hidden-status").text == "wrong"
        Select(browser.find_element(By.ID, "colour")).select_by_value("log_rho")
        toks = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".tok"))
        assert "log rho" in browser.find_element(By.ID, "legend").text
        assert "0.1)" in toks[2].value_of_css_property("background-color")  # rho = 1 on the first action
        assert "0.9)" in toks[3].value_of_css_property("background-color")  # log rho 0.25 is the scale
    finally:
        srv.shutdown()
        srv.server_close()


def test_more_groups_pages_through_a_step(tmp_path: Path, browser: Any) -> None:
    """Issue 40: a step's groups come 50 at a time; "more groups" appends the next page (filters apply first)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.diagnostics.synthetic import write_big_ledger

    srv = make_server(write_big_ledger(tmp_path / "run", steps=2, per_step=1000, group_size=8), 0, None)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    wait = WebDriverWait(browser, 30)
    groups = lambda d: d.find_elements(By.CSS_SELECTOR, ".group")  # noqa: E731
    try:
        browser.get(f"http://127.0.0.1:{srv.server_address[1]}/?step=2")
        wait.until(lambda d: len(groups(d)) == 50)
        assert "1000 of 1000 trajectories, in 125 groups" in browser.find_element(By.ID, "count").text
        more = browser.find_element(By.ID, "more")
        assert more.text == "more groups (50 of 125 shown)"
        more.click()
        wait.until(lambda d: len(groups(d)) == 100)
        browser.find_element(By.ID, "more").click()
        wait.until(lambda d: len(groups(d)) == 125)
        assert not browser.find_elements(By.ID, "more")
        ids = [e.get_attribute("data-id") for e in browser.find_elements(By.CSS_SELECTOR, ".traj")]
        assert len(ids) == len(set(ids)) == 1000 and ids[-1] == "s2-t999"

        # A filter applies before paging: 500 correct trajectories, still in 125 groups, 50 shown again.
        browser.find_element(By.ID, "f-status").send_keys("correct")
        browser.find_element(By.ID, "apply").click()
        wait.until(lambda d: d.find_element(By.ID, "count").text.startswith("500 of 1000"))
        wait.until(lambda d: len(groups(d)) == 50)
        browser.find_element(By.ID, "more").click()
        wait.until(lambda d: len(groups(d)) == 100)
        assert {e.text.split()[0] for e in browser.find_elements(By.CSS_SELECTOR, ".traj")} == {"correct"}
        browser.find_elements(By.CSS_SELECTOR, ".traj")[-1].click()  # a trajectory of the second page opens
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".tok"))
        browser.save_screenshot(str(tmp_path / "viewer_more.png"))
        bad = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert bad == [], bad
    finally:
        srv.shutdown()
        srv.server_close()
