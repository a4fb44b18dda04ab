"""The Prefect UI as a person sees it, in a real browser (headless Chromium driven by selenium).

A server started by `infra/prefect_server.sh` on a non-default port (with PREFECT_API_URL pointing elsewhere,
as a stale shell would), `dapo deploy` serving the tiny deployment, a flow run killed mid-run (the flow-run
process, SIGKILL) and retried from the UI's Retry button. Checked on the pages a person opens: the flow-run
page talks to its own server (no "Can't connect to Server API"), the state badge shows Crashed after the kill,
the Artifacts tab shows a handful of cards with one progress card after the Retry, and the summary's curves
image has loaded. Screenshots are kept in the test's temp folder (printed at the end).
Chromium and chromedriver come from Debian packages (`infra/browser_deps.sh`, run by `.ci/run`); without them
the test is skipped, unless DAPO_REQUIRE_BROWSER=1 (CI), where that is a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from tests.integration.conftest import CONFIG, tiny_overrides
from tests.integration.prefect_server import free_port, healthy, stop, wait_for
from tests.integration.test_prefect_ui import SERVED, _client, _deployment, _descendants, _task_runs

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
"""Train steps of the browser test's run (a checkpoint after each; killed once step 2 is checkpointed)."""


def _browser_paths() -> tuple[str, str] | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium under selenium (Debian's chromium and chromedriver; no download)."""
    paths = _browser_paths()
    if paths is None:
        if os.environ.get("DAPO_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium / chromedriver not found: run infra/browser_deps.sh (as root)")
        pytest.skip("chromium / chromedriver not installed (infra/browser_deps.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = paths[0]
    profile = tmp_path_factory.mktemp("chromium_profile")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=opts, service=Service(paths[1]))
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def script_server(tmp_path_factory, prefect_home):
    """`infra/prefect_server.sh start` on a free port other than 4200, from a shell whose PREFECT_API_URL
    names another address (the UI must still talk to this server)."""
    home = tmp_path_factory.mktemp("browser_prefect")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "PREFECT_HOME": str(home),
        "PREFECT_PORT": str(port),
        "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api",  # a stale export: nobody listens there
        "PREFECT_START_TIMEOUT_S": "300",
    }
    env.pop("PREFECT_UI_API_URL", None)
    script = ROOT / "infra" / "prefect_server.sh"
    started = subprocess.run([str(script), "start"], env=env, capture_output=True, text=True, check=False)
    try:
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        assert healthy(api)
        yield api, {**env, "PREFECT_API_URL": api, "PREFECT_RUNNER_POLL_FREQUENCY": "2"}, home
    finally:
        subprocess.run([str(script), "stop"], env=env, capture_output=True, check=False)


def _wait(browser, cond, timeout: float, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=1).until(cond, f"{what} (after {timeout:.0f} s)")


def _page_text(browser) -> str:
    return browser.find_element("tag name", "body").text


def _open_flow_run(browser, base: str, flow_run_id, shots: Path, name: str) -> None:
    """Open the flow-run page and wait until it shows the run (its state badge)."""
    browser.get(f"{base}/runs/flow-run/{flow_run_id}")
    _wait(
        browser,
        lambda b: b.find_elements("css selector", ".page-heading-flow-run .state-badge"),
        120,
        "badge",
    )
    time.sleep(2)  # let the rest of the page's queries answer
    browser.save_screenshot(str(shots / f"{name}.png"))
    assert "Can't connect to Server API" not in _page_text(browser), f"see {shots / name}.png"


def _badge(browser) -> str:
    badges = browser.find_elements("css selector", ".page-heading-flow-run .state-badge")
    return badges[0].text.strip() if badges else ""


def _artifact_cards(browser, shots: Path, name: str) -> list[str]:
    """Click the Artifacts tab; the cards' titles (waits for at least one card)."""
    _wait(browser, lambda b: b.find_elements("css selector", "li.p-tab#artifacts"), 120, "the tab")[0].click()
    _wait(browser, lambda b: b.find_elements("css selector", ".artifact-card__title"), 120, "artifact cards")
    time.sleep(2)
    browser.save_screenshot(str(shots / f"{name}.png"))
    return [e.text.strip() for e in browser.find_elements("css selector", ".artifact-card__title")]


def _open_card(browser, key: str) -> None:
    """Click the Artifacts tab's card of artifact `key` (opens the artifact's page)."""
    cards = browser.find_elements("css selector", ".artifact-card")
    next(e for e in cards if key in e.find_element("css selector", ".artifact-card__title").text).click()


def _press_retry(browser, shots: Path) -> None:
    """The Retry button of the flow-run page, then the dialog's confirmation."""

    def button(label: str):
        def find(b):
            hits = [e for e in b.find_elements("css selector", "button") if e.text.strip() == label]
            return hits[-1] if hits and hits[-1].is_displayed() and hits[-1].is_enabled() else False

        return find

    _wait(browser, button("Retry"), 120, "the Retry button").click()
    time.sleep(1)
    browser.save_screenshot(str(shots / "3_retry_dialog.png"))
    assert "will be run again" in _page_text(browser) or "persisted result" in _page_text(browser)
    dialog = browser.find_elements("css selector", "[role=dialog], .p-modal")
    buttons = [e for d in dialog for e in d.find_elements("css selector", "button") if e.text.strip()]
    confirm = [e for e in buttons if e.text.strip() in ("Retry", "Submit", "Confirm")]
    assert confirm, [e.text for e in buttons]
    confirm[-1].click()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_person_kills_and_retries_a_run_in_the_browser(browser, script_server, tiny_assets, tmp_path):
    from prefect.client.schemas.objects import StateType

    api, env, _home = script_server
    base = api.removesuffix("/api")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    ov = tiny_overrides(tiny_assets, **{**SERVED, "trainer.total_training_steps": STEPS})
    serve = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "deploy", "--config", str(CONFIG), "--name", "browser", *ov],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        with _client(api) as client:
            dep = _deployment(client, "browser", serve)
            fr = client.create_flow_run_from_deployment(dep.id, parameters={"run_id": "browser"})
            run = tiny_assets / "runs" / "browser"
            wait_for((run / "ckpt" / "step_2").is_dir, 600, "the run's second checkpoint", serve)
            victims = _descendants(serve.pid)  # the flow-run process the runner started (and its children)
            assert victims, "the flow run should run in a child process of the runner"
            for pid in victims:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

            def ended():
                state = client.read_flow_run(fr.id).state
                return state if state is not None and state.is_final() else None

            assert wait_for(ended, 300, "the killed run's final state", serve).type == StateType.CRASHED

            _open_flow_run(browser, base, fr.id, shots, "1_crashed")
            _wait(browser, lambda b: _badge(b) == "Crashed", 120, "the Crashed badge")
            before = _artifact_cards(browser, shots, "2_artifacts_crashed")
            assert 1 <= len(before) <= 6, before

            _open_flow_run(browser, base, fr.id, shots, "2b_crashed_again")
            _press_retry(browser, shots)

            def completed():
                state = client.read_flow_run(fr.id).state
                return state is not None and state.type == StateType.COMPLETED

            wait_for(completed, 600, "the retried run to complete", serve)
            assert client.read_flow_run(fr.id).run_count == 2
            left = _task_runs(client, fr.id)
            assert not [t.name for t in left if t.state_type == StateType.RUNNING]

            _open_flow_run(browser, base, fr.id, shots, "4_completed")
            assert _badge(browser) == "Completed"
            cards = _artifact_cards(browser, shots, "5_artifacts_completed")
            assert len(cards) <= 6, cards
            assert sum(c.endswith("-progress") for c in cards) == 1, cards
            assert {"dapo-browser-progress", "dapo-browser-steps", "dapo-browser-summary"} <= set(cards)

            _open_card(browser, "dapo-browser-summary")
            img = _wait(browser, lambda b: b.find_elements("css selector", "img"), 120, "the curves image")[0]
            _wait(
                browser,
                lambda b: b.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img),
                60,
                "the curves image to load",
            )
            width = browser.execute_script("return arguments[0].naturalWidth", img)
            browser.save_screenshot(str(shots / "6_summary.png"))
            assert width > 0

            _open_flow_run(browser, base, fr.id, shots, "7_completed_again")  # the steps table
            _artifact_cards(browser, shots, "7_artifacts_again")
            _open_card(browser, "dapo-browser-steps")
            rows = lambda b: len(b.find_elements("css selector", "tbody tr")) >= STEPS  # noqa: E731
            _wait(browser, rows, 120, "the table's rows")
            browser.save_screenshot(str(shots / "8_steps_table.png"))
            assert "kept_groups" in _page_text(browser)
    finally:
        stop(serve, signal.SIGKILL)
        print(f"screenshots: {shots}")
