"""A logger that names the site on every line, so that several sites sharing one
process (tests, simulations, a multi-rank site) are told apart in one log."""

from __future__ import annotations

import logging
from typing import Any, MutableMapping

__all__ = ["SiteLog"]


class SiteLog(logging.LoggerAdapter):
    """Prefixes each message with ``"<site_id>: "`` and puts ``site_id`` in the
    record's extra fields (for formatters: ``%(site_id)s``).

    Args:
        logger: the module's logger (``logging.getLogger(__name__)``).
        site_id: the site this engine runs for.
    """

    def __init__(self, logger: logging.Logger, site_id: str) -> None:
        super().__init__(logger, {"site_id": site_id})
        self.site_id = site_id

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**self.extra, **(kwargs.get("extra") or {})}
        return f"{self.site_id}: {msg}", kwargs
