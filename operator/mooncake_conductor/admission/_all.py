"""Imports every admission rule module so each registers itself."""

from . import current_load, prediction  # noqa: F401
