"""The package version, recorded in every run's ``runs`` row (``dynascope_version``)."""

__version__ = "0.1.0"
