"""gunicorn's logger for the portal's web processes (gunicorn.conf.py: logger_class)."""

from __future__ import annotations

import logging

from gunicorn import glogging

__all__ = ["WebLogger"]


class WebLogger(glogging.Logger):
    """gunicorn's own logger, minus the access line its access logger would drop.

    The portal writes its own access line, as JSON with the request id (portal.ops.logging.RequestIdMiddleware),
    and gunicorn.conf.py sets gunicorn.access to WARNING. gunicorn counts access logging as on whenever a
    logconfig_dict is given, so every request still built the line's atoms (headers, times, the request line)
    for a logger that dropped it: about 3 % of a cheap API request's CPU. Built only when it would be written.
    """

    def access(self, resp, req, environ, request_time) -> None:
        if self.access_log.isEnabledFor(logging.INFO):
            super().access(resp, req, environ, request_time)
