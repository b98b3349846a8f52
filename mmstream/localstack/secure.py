"""A secured local KRaft broker for `mmstream up --secure` and the secure integration tests.

It runs beside the plaintext broker, never instead of it: its own ports
(``LocalSettings.kafka_secure_port`` for clients, ``kafka_secure_internal_port`` and
``kafka_secure_controller_port`` on loopback) and its own state under
``<state_dir>/kafka-secure``. Config: infra/kafka/server-secure.properties.

- Clients connect with SASL_SSL (SCRAM-SHA-512). The pipeline's service principal
  (``SERVICE_USER``) gets its SCRAM credential at format time (``StorageTool format
  --add-scram``, KIP-900), so it can log in from the first second; tenants are added later
  through the Admin API (`mmstream tenant add`).
- TLS comes from a local CA made with ``openssl`` on first use and kept in ``tls/``: the CA
  (``ca.pem``, which clients trust), the broker's key and chain (``broker.pem``: CN
  ``BROKER_USER``, names ``localhost`` and ``127.0.0.1``).
- The inter-broker and controller listeners use mutual TLS with that certificate, so the
  broker's principal there is ``User:<BROKER_USER>``; it and the service principal are the
  super users, and nothing is allowed that no ACL allows.

The service password is made once and kept in ``service.password`` (mode 0600); ``env()``
gives the ``MMSTREAM_KAFKA_*`` settings that connect to this broker as the service principal
(with the secured Redis's, ``mmstream.localstack.secure_env``, written to ``mmstream.env`` by
`mmstream up --secure` for a shell to source).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mmstream.localstack import procs
from mmstream.localstack.kafka import LocalKafka
from mmstream.localstack.procs import LocalStackError
from schemas.settings import LocalSettings
from streams.connection import KafkaSecurity

SERVICE_USER = "mmstream"
"""The pipeline's service principal (``User:mmstream``): a super user of the local broker."""
BROKER_USER = "mmstream-broker"
"""The broker's own principal on its mutual-TLS listeners (its certificate's CN)."""
MECHANISM = "SCRAM-SHA-512"
_OPENSSL_HINT = "openssl is needed to make the local broker's certificates: apt-get install openssl"
_CERT_DAYS = 825


class SecureKafka(LocalKafka):
    """The secured local broker (see the module docstring)."""

    template = "server-secure.properties"
    state_name = "kafka-secure"
    serves_tls = True

    def __init__(self, local: LocalSettings, repo_root: Path, host: str = "127.0.0.1",
                 probe_timeout_s: float = 10.0) -> None:
        super().__init__(local, f"{host}:{local.kafka_secure_port}", repo_root, probe_timeout_s)
        self.controller_port = local.kafka_secure_controller_port
        self.internal_port = local.kafka_secure_internal_port
        self.tls = self.root / "tls"
        self.ca_file = self.tls / "ca.pem"

    # -- what clients need ---------------------------------------------------------------

    def service_password(self) -> str:
        """The service principal's password, made on first use and kept (mode 0600)."""
        return procs.kept_secret(self.root / "service.password")

    def security(self) -> KafkaSecurity:
        """How the service principal connects."""
        return KafkaSecurity(protocol="SASL_SSL", mechanism=MECHANISM, username=SERVICE_USER,
                             password=self.service_password(), ca_file=str(self.ca_file))

    def env(self) -> dict[str, str]:
        """The ``MMSTREAM_KAFKA_*`` settings of a client of this broker as the service principal."""
        return {"MMSTREAM_KAFKA_BOOTSTRAP": self.bootstrap, "MMSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                "MMSTREAM_KAFKA_SASL_MECHANISM": MECHANISM, "MMSTREAM_KAFKA_USERNAME": SERVICE_USER,
                "MMSTREAM_KAFKA_PASSWORD": self.service_password(),
                "MMSTREAM_KAFKA_SSL_CA_FILE": str(self.ca_file)}

    def client_kwargs(self) -> dict[str, Any]:
        if not self.ca_file.exists():
            return {"security_protocol": "SASL_SSL"}  # no CA yet: nothing of ours can be running
        return self.security().aiokafka_kwargs()

    # -- LocalKafka's hooks --------------------------------------------------------------

    def _other_ports(self) -> list[tuple[int, str]]:
        return [(self.internal_port, "kafka_secure_internal_port"),
                (self.controller_port, "kafka_secure_controller_port")]

    def _template_values(self, run_dir: Path) -> dict[str, Any]:
        self.ensure_certificates()
        return dict(node_id=1, host=self.host, port=self.port, internal_port=self.internal_port,
                    controller_port=self.controller_port, log_dir=run_dir / "data",
                    keystore=self.tls / "broker.pem", truststore=self.ca_file,
                    super_users=f"User:{BROKER_USER};User:{SERVICE_USER}")

    def _format_args(self) -> list[str]:
        return ["--add-scram", f"{MECHANISM}=[name={SERVICE_USER},password={self.service_password()}]"]

    def _check_ports_free(self) -> None:
        if self.port in (self.controller_port, self.internal_port) or self.controller_port == self.internal_port:
            raise LocalStackError("The secure broker's client, internal and controller ports must differ.")
        super()._check_ports_free()

    # -- the local CA ----------------------------------------------------------------------

    def ensure_certificates(self) -> None:
        """Make the CA and the broker's certificate unless both exist (kept across runs, so
        client properties files that name the CA stay valid)."""
        broker = self.tls / "broker.pem"
        if self.ca_file.exists() and broker.exists():
            return
        openssl = procs.require_tool("openssl", _OPENSSL_HINT)
        self.tls.mkdir(parents=True, exist_ok=True)
        os.chmod(self.tls, 0o700)
        ca_key, key, csr, crt, ext = (self.tls / n for n in ("ca.key", "broker.key", "broker.csr", "broker.crt",
                                                             "broker.ext"))
        curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        procs.run_tool([openssl, "req", "-x509", *curve, "-keyout", str(ca_key), "-out", str(self.ca_file),
                        "-days", str(_CERT_DAYS * 4), "-subj", "/CN=mmstream local CA",
                        "-addext", "basicConstraints=critical,CA:TRUE",
                        "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
                       "Making the local Kafka CA", timeout_s=60)
        procs.run_tool([openssl, "req", *curve, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={BROKER_USER}"],
                       "Making the broker's key", timeout_s=60)
        ext.write_text("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n")
        procs.run_tool([openssl, "x509", "-req", "-in", str(csr), "-CA", str(self.ca_file), "-CAkey", str(ca_key),
                        "-CAcreateserial", "-out", str(crt), "-days", str(_CERT_DAYS), "-extfile", str(ext)],
                       "Signing the broker's certificate", timeout_s=60)
        # The broker reads one PEM file holding its key and its chain (ssl.keystore.type=PEM).
        procs.write_private(broker, key.read_text() + crt.read_text() + self.ca_file.read_text())
        for leftover in (csr, ext):
            leftover.unlink(missing_ok=True)
