import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from ranks import close_pools  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    yield
    close_pools()
