"""The local Kafka broker: jars from Maven Central, one KRaft node started and stopped as a process, SASL."""
