"""The web processes' gunicorn logger builds no access line that its access logger drops (gunicorn.conf.py)."""

from __future__ import annotations

import logging
import logging.config

from gunicorn.config import Config

from portal.ops.weblog import WebLogger

from .test_gunicorn_multiproc_dir import load_config


def _logger(access_level: str) -> WebLogger:
    conf = load_config()
    cfg = Config()
    dict_config = {**conf["logconfig_dict"], "loggers": {
        **conf["logconfig_dict"]["loggers"], "gunicorn.access": {"handlers": [], "level": access_level}}}
    cfg.set("logconfig_dict", dict_config)
    cfg.set("logger_class", conf["logger_class"])
    return cfg.logger_class(cfg)


def _access(logger: WebLogger) -> int:
    built = []
    real = logger.atoms
    logger.atoms = lambda *args: built.append(1) or real(*args)
    environ = {"REQUEST_METHOD": "POST", "RAW_URI": "/api/v1/reservations/", "SERVER_PROTOCOL": "HTTP/1.1"}

    class Response:
        status, status_code, headers, sent, response_length = "201 Created", 201, [], 12, 12

    class Request:
        headers, method, path, query, version, uri = [], "POST", "/api/v1/reservations/", "", (1, 1), "/"

    logger.access(Response(), Request(), environ, __import__("datetime").timedelta(milliseconds=5))
    return len(built)


def test_gunicorn_conf_uses_the_web_logger():
    assert load_config()["logger_class"] == "portal.ops.weblog.WebLogger"


def test_no_access_line_is_built_for_an_access_logger_at_warning():
    # gunicorn's own test of "logging on" is true here (a logconfig_dict is given), as it was in every request.
    logger = _logger("WARNING")
    assert logger.access_log_enabled
    assert _access(logger) == 0


def test_an_access_logger_at_info_still_gets_its_line():
    logger = _logger("INFO")
    assert _access(logger) == 1
    logging.getLogger("gunicorn.access").setLevel(logging.WARNING)  # as the conf leaves it for other tests
