"""The Kafka glue every stage shares: the record loop (``stage``), its consumer and producer
(``io``; ``joint`` for a record answered in several deliveries), offsets committed below the lowest unfinished record (``offsets``), fencing of a
replica that lost its partitions (``fence``), take-over recovery (``recovery``), answers
sent on the reply topics (``replies``), a stage's outputs (``produce``) and its process's CPU priority
(``priority``)."""
