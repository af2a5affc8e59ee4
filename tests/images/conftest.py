"""Prints what the image tier measured (build times, image sizes, start-up and session times) after the run."""
from tests.images.harness import REPORT


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("image tier")
        for key, value in REPORT.items():
            terminalreporter.write_line(f"{key}: {value}")
