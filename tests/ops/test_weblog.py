"""The web processes' gunicorn logger builds no access line that its access logger drops (gunicorn.conf.py)."""

from __future__ import annotations

import logging
from datetime import timedelta

from gunicorn.config import Config

from portal.ops.weblog import WebLogger

from .test_gunicorn_multiproc_dir import load_config


def _logger(access_level: int) -> WebLogger:
    """A WebLogger as gunicorn.conf.py configures it, its access logger at access_level. Not set up: gunicorn's
    setup would configure this process's logging (the root logger included) for every test after this one."""
    cfg = Config()
    cfg.set("logconfig_dict", load_config()["logconfig_dict"])  # with one, gunicorn counts access logging as on
    logger = WebLogger.__new__(WebLogger)
    logger.cfg = cfg
    logger.access_log = logging.getLogger(f"tests.weblog.access.{access_level}")
    logger.access_log.setLevel(access_level)
    logger.access_log.propagate = False
    return logger


def _access(logger: WebLogger) -> int:
    """How many access lines' atoms one request built."""
    built = []
    real = logger.atoms
    logger.atoms = lambda *args: built.append(1) or real(*args)
    environ = {"REQUEST_METHOD": "POST", "RAW_URI": "/api/v1/reservations/", "SERVER_PROTOCOL": "HTTP/1.1"}

    class Response:
        status, status_code, headers, sent, response_length = "201 Created", 201, [], 12, 12

    class Request:
        headers, method, path, query, version, uri = [], "POST", "/api/v1/reservations/", "", (1, 1), "/"

    logger.access(Response(), Request(), environ, timedelta(milliseconds=5))
    return len(built)


def test_gunicorn_conf_uses_the_web_logger_and_drops_gunicorns_access_lines():
    conf = load_config()
    assert conf["logger_class"] == "portal.ops.weblog.WebLogger"
    assert conf["logconfig_dict"]["loggers"]["gunicorn.access"]["level"] == "WARNING"


def test_no_access_line_is_built_for_an_access_logger_at_warning():
    # gunicorn's own test of "logging on" is true here (a logconfig_dict is given), as it was in every request.
    logger = _logger(logging.WARNING)
    assert logger.access_log_enabled
    assert _access(logger) == 0


def test_an_access_logger_at_info_still_gets_its_line():
    assert _access(_logger(logging.INFO)) == 1
