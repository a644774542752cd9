"""Local infrastructure: Apache Kafka without Docker (jars, KRaft broker, SASL) and the ClickHouse DDL."""
