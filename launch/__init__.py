"""Launchers: how a run's services are started and supervised (local processes today)."""
