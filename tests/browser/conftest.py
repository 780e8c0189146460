import shutil

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the test item (``rep_call``), so a fixture can see that the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def browser(request, tmp_path):
    """Debian's Chromium, headless, driven by Selenium; the page saved when the test failed."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need selenium")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,2400"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")), options=options)
    yield driver
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        driver.save_screenshot(str(tmp_path / "failure.png"))
        print(f"the page when the test failed: {tmp_path / 'failure.png'}")
    driver.quit()
