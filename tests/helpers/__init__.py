"""Pieces several test files share: planted runs, naive references, launchers, deadline waits."""
