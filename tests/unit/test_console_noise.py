"""Ray's advice to turn token authentication off, printed at every embedded start, is dropped;
its other warnings are not."""

from __future__ import annotations

import logging

import pytest

from ringtrain.actors.cluster import AUTH_ADVICE_LOGGER, _quiet_auth_advice


def test_the_advice_to_disable_auth_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    _quiet_auth_advice()
    _quiet_auth_advice()  # once is enough, however often a process connects
    logger = logging.getLogger(AUTH_ADVICE_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=AUTH_ADVICE_LOGGER):
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logger.warning("the token file is unreadable")
    assert [r.getMessage() for r in caplog.records] == ["the token file is unreadable"]
