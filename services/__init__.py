"""rollstream: services."""
