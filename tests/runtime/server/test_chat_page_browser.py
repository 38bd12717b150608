"""The chat page in a real headless browser (opt-in: ``EXPERTFS_BROWSER_TESTS=1``): the system
chromium, driven through its chromedriver by selenium (the ``browser`` extra), against a live
``expertfs serve`` on 127.0.0.1 over a tiny synthesised store. A message typed in streams a
reply in piece by piece, the decode tokens/s and the expert hit rate appear, a second turn
sends the conversation (the server reuses the first turn's prompt), and a server with an API
key shows its 401 until the key is set on the page."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from serve_live import build_store, live_server  # noqa: E402

pytestmark = [
    pytest.mark.skipif(os.environ.get("EXPERTFS_BROWSER_TESTS") != "1",
                       reason="opt-in: set EXPERTFS_BROWSER_TESTS=1 (needs chromium, "
                              "chromium-driver and the browser extra)"),
    pytest.mark.slow,
]

WAIT = 120


def _binary(*names: str) -> str:
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    pytest.skip(f"none of {', '.join(names)} is installed (apt-get install chromium "
                "chromium-driver)")


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install -e '.[browser]'")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = _binary("chromium", "chromium-browser", "google-chrome")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--disable-extensions", "--no-first-run"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(_binary("chromedriver")), options=opts)
    drv.set_page_load_timeout(WAIT)
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return build_store(tmp_path_factory.mktemp("browser"))


def _wait(drv, cond, what: str):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(drv, WAIT, poll_frequency=0.05).until(lambda d: cond(d), message=what)


def _text(drv, css: str) -> str:
    from selenium.webdriver.common.by import By
    return drv.find_element(By.CSS_SELECTOR, css).text


def _send(drv, message: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    box = drv.find_element(By.ID, "input")
    box.send_keys(message)
    box.send_keys(Keys.ENTER)


def _watch(drv) -> None:
    """Count, from now on, the changes to the last assistant reply's text."""
    drv.execute_script("""
        window.__pieces = 0;
        new MutationObserver((recs) => {
            for (const r of recs) {
                const m = (r.target.nodeType === 3 ? r.target.parentNode : r.target).closest('.msg');
                if (m && m.classList.contains('assistant')) window.__pieces++;
            }
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true});
    """)


def _done(drv) -> bool:
    return drv.execute_script("return document.getElementById('send').disabled") is False \
        and bool(drv.execute_script("return document.querySelectorAll('.msg.assistant').length"))


def test_a_message_streams_a_reply_and_shows_the_figures(browser, store):
    with live_server(store) as url:
        browser.get(url + "/")
        _wait(browser, lambda d: _text(d, "#model") == "m.efs", "the page read /health")
        browser.execute_script("document.getElementById('maxtokens').value = 24;"
                               "document.getElementById('temperature').value = 0;")
        _watch(browser)
        _send(browser, "Hello there")
        _wait(browser, lambda d: re.fullmatch(r"[\d.]+ tok/s", _text(d, "#tps")),
              "the server's decode tokens/s")
        _wait(browser, _done, "the reply finished")
        reply = _text(browser, ".msg.assistant .text")
        pieces = browser.execute_script("return window.__pieces")
        assert reply, "streamed text appeared"
        assert pieces > 1, f"the reply arrived in {pieces} piece(s), not streamed"
        assert float(_text(browser, "#tps").split()[0]) > 0
        assert "%" in _text(browser, "#hitrate") and "ram" in _text(browser, "#hitrate")
        assert _text(browser, "#error") == ""

        _send(browser, "And again")            # the second turn carries the first
        _wait(browser, lambda d: len(d.execute_script(
            "return document.querySelectorAll('.msg')")) == 4, "the second turn")
        _wait(browser, _done, "the second reply finished")
        reused = int(_text(browser, "#reused").split()[0])
        assert reused > 0, "the second request resent the conversation, its prefix reused"


def test_a_401_is_shown_until_the_key_is_set(browser, store):
    from selenium.webdriver.common.by import By
    with live_server(store, "--api-key", "sekrit") as url:
        browser.get(url + "/")
        browser.execute_script("localStorage.clear(); location.reload();")
        _wait(browser, lambda d: "need" in d.find_element(By.ID, "apikey").get_attribute("class"),
              "the page saw that the server needs a key")
        browser.execute_script("document.getElementById('maxtokens').value = 4;")
        _send(browser, "hi")
        _wait(browser, lambda d: _text(d, "#error"), "the error shown")
        err = _text(browser, "#error")
        assert err.startswith("HTTP 401") and "API key" in err
        assert not browser.find_elements(By.CSS_SELECTOR, ".msg"), "the failed turn is not kept"
        assert browser.find_element(By.ID, "input").get_attribute("value") == "hi"
        key = browser.find_element(By.ID, "apikey")
        key.send_keys("sekrit")
        browser.execute_script("document.getElementById('apikey')"
                               ".dispatchEvent(new Event('change'))")
        browser.find_element(By.ID, "send").click()
        _wait(browser, _done, "the reply with the key")
        assert _text(browser, "#error") == ""
        assert len(browser.find_elements(By.CSS_SELECTOR, ".msg")) == 2
