"""Pure policies: plain data in, a decision out. They take ``now`` (monotonic seconds) and,
where they need one, a random source; they never touch Kafka or Redis."""
