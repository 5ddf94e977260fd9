"""pytest configuration: make the shared reference folder and local helpers importable."""

import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# The published values live in tests/reference (its README names their sources);
# DPZERO_REFERENCE_DIR names another copy, as CMake's option of that name does.
REFERENCE_DIR = os.environ.get("DPZERO_REFERENCE_DIR") or os.path.join(HERE, "..", "reference")
REFERENCE_CASES = os.path.abspath(os.path.join(REFERENCE_DIR, "accounting_cases.json"))


@pytest.fixture(scope="session")
def accounting_cases():
    if not os.path.exists(REFERENCE_CASES):
        pytest.fail(f"reference file missing: {REFERENCE_CASES} (tests/reference in the "
                    "checkout, or a copy named by DPZERO_REFERENCE_DIR)")
    with open(REFERENCE_CASES) as f:
        return json.load(f)


def pytest_collection_modifyitems(config, items):
    """A twin's CUDA case (a test parametrized over devices, design.md §6) is in the gpu tier."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(v == "cuda" or (isinstance(v, torch.device) and v.type == "cuda")
               for v in params.values() if isinstance(v, (str, torch.device))):
            item.add_marker(pytest.mark.gpu)
