"""The package version (its own module: the daemon reports it without loading the SDK)."""

__version__ = "0.1.0"
