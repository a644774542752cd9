"""The Kafka layer: the bus (clients, records, admin), the service runtime, the local broker."""
