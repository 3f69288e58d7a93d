"""Vendor implementations: each file is tied to one or more platforms and counted as debt.

Nothing here is imported by model code; the catalogue registers these functions and
the ledger records each one. A vendor library is imported inside the function that
needs it, so a missing library makes the implementation unavailable, not ferry.
"""
