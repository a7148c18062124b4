"""Compatibility namespace: ``ems.common.exception`` as real clients import it."""
