"""pytest configuration: make the shared reference folder and local helpers importable."""

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

REFERENCE_CASES = os.path.abspath(
    os.path.join(HERE, "..", "..", "..", "shared", "reference", "accounting_cases.json")
)


@pytest.fixture(scope="session")
def accounting_cases():
    if not os.path.exists(REFERENCE_CASES):
        pytest.fail(f"reference file missing: {REFERENCE_CASES} (../shared beside the checkout)")
    with open(REFERENCE_CASES) as f:
        return json.load(f)
