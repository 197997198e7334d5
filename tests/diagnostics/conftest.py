"""The one headless-Chromium fixture of the diagnostics browser tests (test_viewer_browser.py,
test_dashboard_browser.py). Skips only when Chromium itself is absent (CI installs ``chromium`` and
``chromium-driver``); selenium comes with the ``dev`` extra, so a missing selenium is a failure."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,900")


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        why = "chromium is not installed (apt-get install -y chromium chromium-driver); browser test skipped"
        print(why)
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console entries for the SEVERE checks
    profile = tempfile.mkdtemp(prefix="posttrain-chromium-")
    for f in (*FLAGS, f"--user-data-dir={profile}"):
        opts.add_argument(f)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
