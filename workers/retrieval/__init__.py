"""Retrieval compute, no Kafka: one collection's ANN index (``index``) and the offline
passage corpus the benchmark and tests use (``corpus``). The Kafka stages that feed and query
an index live in ``streams``."""
