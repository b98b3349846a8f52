"""The client SDK: what a user's program imports to send requests and read answers.

It imports only ``schemas`` (the wire formats and topic names) and ``streams.connection``
(how a Kafka or Redis client of mmstream authenticates); never a stage, a core, a policy or
compute. An import contract in pyproject.toml holds that, so the SDK stays something a client
can install and load without the pipeline's engines.
"""

from streams.sdk.client import Client, ClientError, Submission, new_id
from streams.sdk.retry import NO_RETRY, RetryConfig
from streams.sdk.transport import KafkaTransport, Transport, TransportError

__all__ = ["NO_RETRY", "Client", "ClientError", "KafkaTransport", "RetryConfig", "Submission", "Transport",
           "TransportError", "new_id"]
