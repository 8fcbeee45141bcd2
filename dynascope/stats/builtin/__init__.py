"""The statistics that ship: one family per file, each declaring ``STATISTICS`` (see ``stats.registry``)."""
