import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the test item (``rep_call``), so a fixture can see that the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
