"""TEMPORARY re-export: the publisher is ``attnum.site``; delete once tests/studies import it from there."""
from attnum.site import publish  # noqa: F401
