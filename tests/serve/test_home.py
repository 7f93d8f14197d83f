"""``pipemap serve``'s home page: the plan picture, live figures from ``/metrics``, and a prompt box, checked over
HTTP and in a real headless Chromium (Selenium; ``scripts/test.sh`` installs Chromium where it is missing)."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET

import pytest

import pipemap
from serving import ROOM, roomy_hardware

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
from pipemap.serve import Background, Options, Service  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def served(tiny_folders):
    """The tiny SD pipeline on a plan that offloads (so links carry bytes), remapped onto the CPU."""
    folder = tiny_folders["sd"]
    # room for the activations of a call at the page's default size, which the memory ledger admits
    service = Service.load(Options(folder, hardware=roomy_hardware(pipemap.inspect(folder)),
                                   strategy="balanced_low_memory", headroom=ROOM, timeout=120.0))
    with Background(service) as address:
        yield service, address


def _svg(html: str) -> ET.Element:
    return ET.fromstring(html[html.index("<svg"):html.index("</svg>") + 6])


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_home_page_draws_the_plan_and_reads_metrics_that_exist(served):
    service, url = served
    with httpx.Client(base_url=url, timeout=60) as client:
        page = client.get("/")
        metrics = client.get("/metrics").text
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    groups = {g.get("data-device"): g for g in _svg(page.text).iter(f"{SVG}g") if g.get("class") == "device"}
    assert set(groups) == {d.device for d in service.plan.devices}
    for use in service.plan.devices:
        assert int(groups[use.device].get("data-used")) == use.used
    links = [g for g in _svg(page.text).iter(f"{SVG}g") if g.get("class") == "link"]
    assert links and all(int(g.get("data-bytes")) > 0 for g in links)  # offloaded components cross the host link
    for name in re.findall(r'show\("\w+", "(\w+)"', page.text) + ["pipemap_image_seconds_sum"]:
        assert re.search(rf"^(# HELP )?{name}\b", metrics, re.M), f"the page reads {name}, which /metrics lacks"


def _browser():
    binary = next((b for b in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if b),
                  None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no Chromium and chromedriver on PATH: bash scripts/test.sh installs them (apt)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install -e '.[test]' (selenium)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    from selenium.webdriver.chrome.service import Service as Driver

    return webdriver.Chrome(service=Driver(driver), options=options)


@pytest.mark.slow  # over 1 s on 2 cores: out of the quick subset
def test_a_browser_sees_the_picture_submits_a_prompt_and_gets_an_image(served):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    service, url = served
    browser = _browser()
    try:
        browser.get(url + "/")
        bars = browser.find_elements(By.CSS_SELECTOR, "#plan svg g.device")
        assert {b.get_attribute("data-device") for b in bars} == {d.device for d in service.plan.devices}
        steps = browser.find_element(By.ID, "steps")
        steps.clear()
        steps.send_keys("2")
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("a tiny cat")
        browser.find_element(By.ID, "go").click()
        image = WebDriverWait(browser, 120).until(lambda b: b.find_elements(By.ID, "image"))[0]
        WebDriverWait(browser, 30).until(lambda b: b.execute_script(
            "const i = document.getElementById('image'); return i.complete && i.naturalWidth > 0;"))
        assert image.get_attribute("src").startswith("data:image/png;base64,")
        # the live figures refresh every 2 s from /metrics: the request just answered is counted
        WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "requests").text not in ("-", "0"))
        assert float(browser.find_element(By.ID, "seconds").text) > 0
    finally:
        browser.quit()
