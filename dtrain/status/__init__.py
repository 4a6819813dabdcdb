"""The run's status: the model built from the sites' round reports (``model``), the
page that renders it (``page``) and the read-only HTTP server (``http``).

Importing this package loads only the model (no HTTP, no prometheus-client).
"""

from dtrain.status.model import (
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

__all__ = [
    "REPORT_FIELDS",
    "MAX_REPORT_BYTES",
    "MAX_REPORTS_PER_HEARTBEAT",
    "SITE_STATES",
    "round_report",
    "parse_report",
    "StatusLog",
    "decide_site_state",
    "build_status",
]
