"""The chat page in real headless Chromium (Debian's chromium + chromedriver, installed by scripts/test.sh)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import httpx
import pytest
from server_helpers import MODEL_NAME, ScriptedEngine, live_server
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from astrai.serving import create_app

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

# Counts changes inside assistant bubbles, to see the reply arrive in pieces rather than at once.
WATCH_UPDATES = """
window.__updates = 0;
new MutationObserver((mutations) => {
  for (const m of mutations) {
    const node = m.target.nodeType === Node.ELEMENT_NODE ? m.target : m.target.parentElement;
    if (node && node.closest('.message.assistant')) window.__updates += 1;
  }
}).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
"""


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-dev-shm-usage", "--window-size=1100,750"):
        options.add_argument(flag)
    # Chromium puts its profile and singleton-socket directories under TMPDIR: one of the test's own,
    # removed after, so none are left behind. Short, since a socket's path holds at most 107 bytes.
    scratch = tempfile.mkdtemp(prefix="astrai-chromium-")
    service = Service(CHROMEDRIVER, env={**os.environ, "TMPDIR": scratch})
    try:
        driver = webdriver.Chrome(service=service, options=options)
        driver.set_page_load_timeout(30)
        yield driver
        driver.quit()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def set_field(driver, element_id: str, value: str) -> None:
    driver.execute_script("const el = document.getElementById(arguments[0]); el.value = arguments[1];"
                          "el.dispatchEvent(new Event('change'));", element_id, value)


def wait_idle(driver) -> None:
    WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "send").is_enabled()
                                    and not d.find_elements(By.CSS_SELECTOR, ".message.streaming"))


def test_chat_page_streams_a_reply_in_english_and_chinese(browser, server_url, tmp_path):
    browser.get(server_url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model-name").text == MODEL_NAME)
    set_field(browser, "max_tokens", "40")
    set_field(browser, "temperature", "0")  # greedy: the same reply, in the same pieces, every run
    set_field(browser, "system", "You are a helpful assistant.")
    browser.execute_script(WATCH_UPDATES)
    box = browser.find_element(By.ID, "input")
    box.send_keys("Hello, who are you?")
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant"))
    wait_idle(browser)
    replies = browser.find_elements(By.CSS_SELECTOR, ".message.assistant")
    status = browser.find_element(By.ID, "status").text
    assert len(replies) == 1 and replies[0].get_attribute("textContent")
    assert status.startswith("Done") and "tokens" in status
    assert browser.execute_script("return window.__updates") >= 5  # the reply grew piece by piece
    assert not browser.find_elements(By.CSS_SELECTOR, ".message.error")

    set_field(browser, "lang", "zh")
    assert browser.find_element(By.ID, "send").text == "发送"
    box.send_keys("你好，请介绍一下你自己")
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".message.assistant")) == 2)
    wait_idle(browser)
    users = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".message.user")]
    assert users == ["Hello, who are you?", "你好，请介绍一下你自己"]
    assert browser.find_element(By.ID, "status").text.startswith("完成")
    history = browser.execute_script("return JSON.parse(localStorage.getItem('astrai.history'))")
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    browser.save_screenshot(str(tmp_path / "chat_page.png"))
    assert (tmp_path / "chat_page.png").stat().st_size > 10_000


def test_chat_page_stop_button_aborts_a_slow_scripted_stream(browser, tokenizer, tmp_path):
    engine = ScriptedEngine(tokenizer, "slow words " * 100, delay_s=0.05)
    with live_server(create_app(engine, model_name=MODEL_NAME)) as url:
        browser.get(url + "/")
        WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model-name").text == MODEL_NAME)
        browser.find_element(By.ID, "input").send_keys("Talk slowly")
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 30).until(
            lambda d: "slow" in d.find_element(By.CSS_SELECTOR, ".message.assistant").get_attribute("textContent"))
        browser.find_element(By.ID, "stop").click()
        wait_idle(browser)
        assert browser.find_element(By.ID, "status").text == "Stopped."
        deadline = time.monotonic() + 5
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.running and engine.handles[0].aborted
        assert engine.handles[0].events_sent < 200
        assert httpx.get(url + "/stats").json()["running"] == 0
        browser.save_screenshot(str(tmp_path / "chat_page_stopped.png"))
