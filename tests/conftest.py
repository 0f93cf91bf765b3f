"""Shared test set-up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _serve_groups_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The serving tools list their servers' process groups in a file (``serve_check``): the
    tests' own, never the machine's."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("serve") / "serve-groups.json"
        patch.setenv("ROWCACHE_SERVE_GROUPS", str(path))
        yield
