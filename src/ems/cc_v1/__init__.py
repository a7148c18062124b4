"""Compatibility namespace of the original SDK's V1 modules."""
