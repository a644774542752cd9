"""rollstream: trainer."""
