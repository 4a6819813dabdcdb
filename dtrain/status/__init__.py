"""The run's status: the model built from the sites' round reports (``model``), the
page that renders it (``page``) and the read-only HTTP server (``http``).

Importing this package loads only the model (no HTTP, no prometheus-client).
"""

from dtrain.status import model
from dtrain.status.model import (  # noqa: F401 - re-exported: __all__ is model.__all__
    MAX_REPORT_BYTES,
    MAX_REPORTS_PER_HEARTBEAT,
    REPORT_FIELDS,
    SITE_STATES,
    StatusLog,
    build_status,
    decide_site_state,
    parse_report,
    round_report,
)

__all__ = model.__all__  # the model's public names, listed once (in dtrain/status/model.py)
