"""Diagnostics of finished (or still running) runs, read from the ledger and metrics alone.

A layer above ``trajectory/`` and ``evaluation/`` and below ``commands/``: nothing here imports
``loop/``. ``load`` reads run directories, ``strata`` / ``trends`` / ``symptoms`` compute the
report, ``plots`` / ``html`` render it, ``budget`` / ``fairness`` back ``posttrain compare``, and
``runs`` / ``dashboard_*`` / ``viewer_*`` back ``posttrain view``.
"""
