"""rollstream: envs."""
