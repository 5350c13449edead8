"""The browser tests' one strict build of the default scenario (tests/book/built.py)."""

import pytest
from tests.book.built import build_default


@pytest.fixture(scope="session")
def built_book() -> str:
    """Sphinx's output of this session's build of the default scenario."""
    return build_default()
