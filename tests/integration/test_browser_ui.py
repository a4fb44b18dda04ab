"""The Prefect UI as a person sees it, in a real browser (headless Chromium driven by selenium).

A server started by `infra/prefect_server.sh` on a non-default port (with PREFECT_API_URL pointing elsewhere,
as a stale shell would), `dapo deploy` serving the tiny deployment, a flow run killed mid-run (the flow-run
process, SIGKILL, while `DAPO_FAULT=hang@...` holds it in its last step) and retried from the UI's Retry
button. Checked on the pages a person opens, starting from the server's address as the README does (opened
while the run trains): it opens the classic UI (the one described here, not Prefect 3.9's /v2), whose API is
this server's (no "Can't connect to Server API"); the open flow-run page's state badge turns Crashed after
the kill; the Artifacts tab shows a handful of cards with one progress card after the Retry; the summary's
curves image has loaded; every steps-table column has values. The `dapo deploy` shell stays quiet: no line per
finished task run, at most one line per train step and attempt. Screenshots and the `dapo deploy` output are
kept in the test's temp folder (printed at the end).
Every wait is explicit (a condition polled up to a limit) and draws on one time budget, so that a slow
machine fails with what it waited for, within the test's own timeout.
Chromium and chromedriver come from Debian packages (`infra/browser_deps.sh`, run by `.ci/run`); without them
the test is skipped, unless DAPO_REQUIRE_BROWSER=1 (CI), where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from contextlib import suppress
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.integration.conftest import CONFIG, tiny_overrides
from tests.integration.prefect_server import free_port, healthy, stop
from tests.integration.test_prefect_ui import SERVED, _client, _deployment, _descendants, _settled_task_runs

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
"""Train steps of the browser test's run (a checkpoint after each; killed while held in the last, which the
Retry trains: the steps table has a row from each attempt)."""
HANG = f"hang@generate_g0:{STEPS}:browser"
"""`DAPO_FAULT` of the served flow runs: the run `browser` sleeps in its last step's generation (once: the
retried attempt passes), where the test kills it."""

TEST_TIMEOUT_S = 1200
"""The test's own limit (pytest-timeout; it counts fixture set-up too). Its parts: the server's start-up
(`SERVER_START_S`), the test body (`BODY_S`, shared by every wait in it), the teardown (`TEARDOWN_S`), and
what is left (> 200 s) for the session's tiny data and base model when this is the first test to need them."""
SERVER_START_S = 180
"""`infra/prefect_server.sh start` waits this long for the server (PREFECT_START_TIMEOUT_S)."""
BODY_S = 720
"""Every wait of the test body together: a wait takes at most what is left of this."""
TEARDOWN_S = 90
"""Stopping `dapo deploy` (SIGKILL, ≤ 30 s) and the server (SIGTERM, ≤ 30 s, then SIGKILL), the browser."""
PAGE_LOAD_S = 60
"""The browser's limit for one page load."""
assert SERVER_START_S + BODY_S + TEARDOWN_S + 200 <= TEST_TIMEOUT_S


class Budget:
    """A time budget shared by consecutive waits: `left(cap)` is min(cap, the seconds left); spent: fails."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        left = self.end - time.monotonic()
        assert left > 1, f"the test body's time budget ({self.seconds:.0f} s) is spent"
        return min(cap, left)


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
    driver.set_page_load_timeout(PAGE_LOAD_S)
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
        "PREFECT_START_TIMEOUT_S": str(SERVER_START_S),
    }
    for name in ("PREFECT_UI_API_URL", "PREFECT_SERVER_UI_API_URL", "PREFECT_SERVER_UI_V2_ENABLED"):
        env.pop(name, None)  # what the script sets unless given: a person's shell has none of them
    script = ROOT / "infra" / "prefect_server.sh"
    started = subprocess.run([str(script), "start"], env=env, capture_output=True, text=True, check=False)
    try:
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        assert healthy(api)
        yield api, {**env, "PREFECT_API_URL": api, "PREFECT_RUNNER_POLL_FREQUENCY": "2"}, home
    finally:
        subprocess.run([str(script), "stop"], env=env, capture_output=True, check=False)


def _wait(browser, cond, timeout: float, what: str):
    """Poll `cond(browser)` (every 0.5 s) until it returns something truthy, which is returned."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(
        browser, timeout, poll_frequency=0.5, ignored_exceptions=(StaleElementReferenceException,)
    )
    return wait.until(cond, f"{what} (after {timeout:.0f} s; see the screenshots)")


def _page_text(browser) -> str:
    return browser.find_element("tag name", "body").text


_FIND = """const [css, text, scope, has] = arguments;
  const scopes = scope ? [...document.querySelectorAll(scope)] : [];
  const roots = scope ? scopes.filter(r => r.innerText.includes(has)) : [document];
  const found = roots.flatMap(r => [...r.querySelectorAll(css)]);
  return text === null ? found : found.filter(e => e.innerText.trim() === text);"""


def _find(browser, css: str, text: str | None = None, scope: str | None = None, has: str = "") -> list:
    """The elements matching `css` whose visible text is `text` (any, for None), inside the `scope` elements
    whose text contains `has` when `scope` is given: one round trip to the browser (reading each element's
    text through selenium is one round trip per element, slow on a busy machine)."""
    return browser.execute_script(_FIND, css, text, scope, has)


BADGE = ".page-heading-flow-run .state-badge"
"""The flow-run page's state badge (drawn once the page's query of the flow run answered)."""


def _badge(browser) -> str:
    badges = browser.find_elements("css selector", BADGE)
    return badges[0].text.strip() if badges else ""


def _shot(browser, shots: Path, name: str) -> Path:
    path = shots / f"{name}.png"
    browser.save_screenshot(str(path))
    return path


def _no_connection_error(browser, shot: Path) -> None:
    assert "Can't connect to Server API" not in _page_text(browser), f"see {shot}"


def _from_the_address(browser, base: str, flow_run, budget: Budget, shots: Path) -> None:
    """What the README has a person do: open the server's address, then Runs, then the flow run's name."""
    browser.get(f"{base}/")
    nav = _wait(
        browser,
        lambda b: _find(b, "a.p-context-nav-item", "Runs"),
        budget.left(60),
        "the classic UI's side bar",
    )
    shot = _shot(browser, shots, "0_address")
    path = browser.execute_script("return location.pathname")
    assert not path.startswith("/v2"), f"{base} opened {path}, Prefect's new UI (see {shot})"
    _no_connection_error(browser, shot)
    nav[0].click()
    link = f"a[href$='/runs/flow-run/{flow_run.id}']"
    shown = lambda b: [e for e in b.find_elements("css selector", link) if e.is_displayed()]  # noqa: E731
    found = _wait(browser, shown, budget.left(60), "the flow run's name under Runs")
    _no_connection_error(browser, _shot(browser, shots, "0_runs"))
    found[0].click()
    _wait(browser, lambda b: b.find_elements("css selector", BADGE), budget.left(60), "the run's state badge")
    _no_connection_error(browser, _shot(browser, shots, "1_flow_run"))


def _open_flow_run(browser, base: str, flow_run_id, budget: Budget, shots: Path, name: str) -> None:
    """Open the flow-run page; wait until it shows the run (its state badge: the UI's API answered)."""
    browser.get(f"{base}/runs/flow-run/{flow_run_id}")
    _wait(browser, lambda b: b.find_elements("css selector", BADGE), budget.left(60), "the state badge")
    _no_connection_error(browser, _shot(browser, shots, name))


def _artifact_cards(browser, budget: Budget, shots: Path, name: str, want: set[str]) -> list[str]:
    """Click the Artifacts tab; the cards' titles, once the cards `want` are among them."""
    tab = lambda b: b.find_elements("css selector", "li.p-tab#artifacts")  # noqa: E731
    _wait(browser, tab, budget.left(60), "the Artifacts tab")[0].click()
    js = "return [...document.querySelectorAll('.artifact-card__title')].map(e => e.innerText.trim())"

    def titles(b):
        got = b.execute_script(js)
        return got if want <= set(got) else None

    try:
        return _wait(browser, titles, budget.left(60), f"the artifact cards {sorted(want)}")
    finally:
        _shot(browser, shots, name)


def _open_card(browser, key: str) -> None:
    """Click the Artifacts tab's card of artifact `key` (opens the artifact's page)."""
    js = """return [...document.querySelectorAll('.artifact-card')]
      .find(c => c.querySelector('.artifact-card__title').innerText.includes(arguments[0]))"""
    browser.execute_script(js, key).click()


def _press_retry(browser, budget: Budget, shots: Path) -> None:
    """The Retry button of the flow-run page, then the dialog's Retry."""

    def shown(hits: list):
        return hits[-1] if hits and hits[-1].is_displayed() and hits[-1].is_enabled() else False

    def page_button(b):
        return shown(_find(b, "button", "Retry"))

    def dialog_button(b):
        return shown(_find(b, "button", "Retry", scope=".p-modal", has="persisted result"))

    _wait(browser, page_button, budget.left(60), "the Retry button").click()
    try:
        confirm = _wait(browser, dialog_button, budget.left(30), "the Retry dialog")
    finally:
        _shot(browser, shots, "3_retry_dialog")
    confirm.click()
    _wait(browser, lambda b: not dialog_button(b), budget.left(30), "the Retry dialog to close")


CURVES = "img[alt='training curves'][src^='data:image/png;base64,']"
"""The summary's curves (flows/artifacts.py embeds curves.png as this image)."""


def _curves_width(browser, budget: Budget) -> int:
    img = _wait(browser, lambda b: b.find_elements("css selector", CURVES), budget.left(60), "the curves")[0]
    js = "return arguments[0].complete && arguments[0].naturalWidth"
    return _wait(browser, lambda b: b.execute_script(js, img), budget.left(30), "the curves image to load")


def _table(browser) -> tuple[list[str], list[list[str]]]:
    """The artifact page's table: header names and rows of cell texts (also cells scrolled out of view)."""
    js = """const t = document.querySelector('table');
      if (!t) return null;
      const cells = (r, tag) => [...r.querySelectorAll(tag)].map(c => c.textContent.trim());
      const rows = [...t.querySelectorAll('tbody tr')].map(r => cells(r, 'td'));
      return [cells(t.querySelector('thead') || t, 'th'), rows];"""
    got = browser.execute_script(js)
    return (got[0], got[1]) if got else ([], [])


def _steps_artifacts(client, flow_run_id) -> list:
    """The flow run's steps-table artifacts, through the API."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    return client.read_artifacts(
        artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["dapo-browser-steps"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
        )
    )


def _steps_published(client, flow_run_id) -> list[dict]:
    """The rows of the flow run's steps-table artifact, through the API (one artifact per key and run)."""
    found = _steps_artifacts(client, flow_run_id)
    assert len(found) == 1, f"{len(found)} steps-table artifacts in the flow run: {found}"
    data = found[0].data
    return json.loads(data) if isinstance(data, str) else list(data)


def _warnings(log: Path) -> list[str]:
    """The `dapo deploy` output's lines about artifacts that could not be published."""
    return [line for line in log.read_text(errors="replace").splitlines() if "could not publish" in line]


def _quiet(log: Path) -> str:
    """The `dapo deploy` shell's output; asserts it is quiet (none of Prefect's per-task-run lines, at most
    one line per train step and attempt) and not silent (the flow run's info lines reach it)."""
    text = log.read_text(errors="replace")
    per_task = [line for line in text.splitlines() if "Task run" in line and "Finished in state" in line]
    assert not per_task, f"{len(per_task)} per-task lines in {log}, e.g. {per_task[:3]}"
    steps = Counter(int(m) for m in re.findall(r"step (\d+) \(gen_step \d+\) done in", text))
    assert steps, f"no step line in {log}: the flow run's info lines should reach the shell"
    assert max(steps.values()) <= 2, f"a step's line more than once per attempt in {log}: {steps}"
    return text


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_person_kills_and_retries_a_run_in_the_browser(browser, script_server, tiny_assets, tmp_path):
    from prefect.client.schemas.objects import StateType

    api, env, _home = script_server
    base = api.removesuffix("/api")
    with urllib.request.urlopen(f"{base}/ui-settings", timeout=10) as r:  # what the UI's page asks first
        ui = json.load(r)
    assert ui["api_url"] == api and ui["default_ui"] == "v1", ui
    budget = Budget(BODY_S)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    log = tmp_path / "dapo_deploy.log"  # the `dapo deploy` shell: what a person sees there
    ov = tiny_overrides(tiny_assets, **{**SERVED, "trainer.total_training_steps": STEPS})
    serve_env = {k: v for k, v in env.items() if k != "PREFECT_LOGGING_LEVEL"}  # a person's: INFO
    serve_env["DAPO_FAULT"] = HANG
    with log.open("wb") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "deploy", "--config", str(CONFIG), "--name", "browser", *ov],
            env=serve_env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with _client(api) as client:
            dep = _deployment(client, "browser", serve, budget.left(180))
            fr = client.create_flow_run_from_deployment(dep.id, parameters={"run_id": "browser"})
            _from_the_address(browser, base, fr, budget, shots)  # while the runner starts the flow run
            held = tiny_assets / "runs" / "browser" / "faults" / f"hang@generate_g0#0:{STEPS}.done"
            wait_for(
                lambda: held.exists() and _steps_artifacts(client, fr.id),  # the table has step 1's row
                f"the run to be held in step {STEPS}, its steps table published",
                budget.left(300),
                0.5,
                alive=serve,
            )
            victims = _descendants(serve.pid)  # the flow-run process the runner started (and its children)
            assert victims, "the flow run should run in a child process of the runner"
            for pid in victims:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

            def ended():
                state = client.read_flow_run(fr.id).state
                return state if state is not None and state.is_final() else None

            state = wait_for(ended, "the killed run's final state", budget.left(120), 0.5, alive=serve)
            assert state.type == StateType.CRASHED, state

            # the open flow-run page reads the run again every 5 s
            try:
                _wait(browser, lambda b: _badge(b) == "Crashed", budget.left(60), "the Crashed badge")
            finally:
                _shot(browser, shots, "1b_crashed")
            want = {"dapo-browser-progress", "dapo-browser-steps"}
            before = _artifact_cards(browser, budget, shots, "2_artifacts_crashed", want)
            assert len(before) <= 6, before

            _press_retry(browser, budget, shots)  # the page's header, beside the Artifacts tab

            def completed():
                state = client.read_flow_run(fr.id).state
                return state is not None and state.type == StateType.COMPLETED

            wait_for(completed, "the retried run to complete", budget.left(300), 0.5, alive=serve)
            assert client.read_flow_run(fr.id).run_count == 2
            _settled_task_runs(client, fr.id)  # none runs forever

            _open_flow_run(browser, base, fr.id, budget, shots, "4_completed")
            _wait(browser, lambda b: _badge(b) == "Completed", budget.left(60), "the Completed badge")
            want.add("dapo-browser-summary")
            cards = _artifact_cards(browser, budget, shots, "5_artifacts_completed", want)
            assert len(cards) <= 6, cards
            assert sum(c.endswith("-progress") for c in cards) == 1, cards

            _open_card(browser, "dapo-browser-summary")
            try:
                assert _curves_width(browser, budget) > 0
            finally:
                _shot(browser, shots, "6_summary")

            published = _steps_published(client, fr.id)  # what the flow run published, before the page
            assert [r["step"] for r in published] == list(range(STEPS, 0, -1)), (published, _warnings(log))
            browser.back()  # to the flow-run page: the single-page app's history, no reload
            _wait(
                browser, lambda b: b.find_elements("css selector", BADGE), budget.left(60), "the state badge"
            )
            _no_connection_error(browser, _shot(browser, shots, "7_completed_again"))
            _artifact_cards(browser, budget, shots, "7_artifacts_again", want)
            _open_card(browser, "dapo-browser-steps")
            try:
                rows = lambda b: len(_table(b)[1]) >= STEPS  # noqa: E731
                _wait(browser, rows, budget.left(60), f"the steps table's {STEPS} rows")
            except Exception as exc:
                shown = _table(browser)
                raise AssertionError(f"{exc}; the page shows {shown}; published: {published}") from exc
            finally:
                _shot(browser, shots, "8_steps_table")
            header, cells = _table(browser)
            assert "kept_groups" in header, header
            assert [r[0] for r in cells] == [str(s) for s in range(STEPS, 0, -1)], cells  # newest first
            empty = {h for r in cells for h, c in zip(header, r, strict=True) if not c and h != "val_acc"}
            assert not empty, f"steps-table columns without a value: {sorted(empty)}"
        _quiet(log)
    finally:
        stop(serve, signal.SIGKILL)
        print(f"screenshots: {shots}; dapo deploy output: {log}")
