"""rollstream: rollout."""
