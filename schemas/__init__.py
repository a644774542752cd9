"""Event Structs, the topic registry and run config Structs. No I/O, imports nothing of ours."""

from schemas.config import ConfigError, RunConfig, parse_config, parse_raw
from schemas.events import ALL_EVENT_TYPES, Event
from schemas.topics import TOPICS, TopicSpec, check_run_id, parse_topic, topic_name

__all__ = [
    "ALL_EVENT_TYPES",
    "TOPICS",
    "ConfigError",
    "Event",
    "RunConfig",
    "TopicSpec",
    "check_run_id",
    "parse_config",
    "parse_raw",
    "parse_topic",
    "topic_name",
]
