"""Redis ACL users of a deployment, as text for an ACL file (``aclfile``); pure.

Two kinds of user, from the URLs the settings give (``redis://user:password@host/db``):

- the **workers** (``settings.redis.url``): every key under ``mm:`` (reuse cache, whole
  answers, load reports, model identities, claim checks), no dangerous commands (no
  FLUSHALL, CONFIG, KEYS, ACL...) except INFO for `mmstream status`;
- the **clients** (``settings.redis.client_url``): SET and GET of claim checks only, under
  ``mm:claim:*`` — or, for one tenant's own user (``client_rule(prefix=claim_prefix(t))``),
  under ``mm:claim:<tenant>:*`` only. A client so can neither read another tenant's claim
  checks nor write cache entries, load reports or model identities.

With no password in either URL there are no users (the server's default user, open, as a
loopback cache always was). Passwords go into the file as SHA-256 (``#<hex>``), never in
the clear. A URL without a user name (``redis://:secret@host``) is Redis's ``default`` user.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

WORKER_RULE = "~mm:* resetchannels &mm:* +@all -@dangerous +info"
"""Every ``mm:`` key, no dangerous command but INFO."""
CLIENT_COMMANDS = "-@all +get +set +ping +hello +auth"
"""redis-py also sends CLIENT SETINFO on connect (Redis 7.2+); it ignores the refusal. No
SELECT: a client's claim checks are in database 0, where the router's sweep bounds them (key
patterns hold in every database, so another one would be a place the sweep never sees)."""
ADMIN_RULE = "~* &* +@all"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")


@dataclass(frozen=True, slots=True)
class AclUser:
    name: str
    password: str
    rule: str
    """Key patterns, channels and commands, in ACL SETUSER syntax."""

    def line(self) -> str:
        """The user's line in an ACL file (its password hashed)."""
        return f"user {self.name} reset on #{hashlib.sha256(self.password.encode()).hexdigest()} {self.rule}"


def client_rule(prefix: str = "mm:claim:") -> str:
    """SET and GET of the keys under ``prefix`` (all claim checks, or one tenant's)."""
    if not prefix.startswith("mm:claim:") or any(c in prefix for c in " *?[]\\\n"):
        raise ValueError(f"{prefix!r} is not a claim-check prefix")
    return f"~{prefix}* resetchannels {CLIENT_COMMANDS}"


def credentials(url: str) -> tuple[str, str] | None:
    """(user, password) of a URL that has a password; the user is ``default`` when unnamed."""
    if not url:
        return None
    parts = urlsplit(url)
    if parts.password is None:
        return None
    user = unquote(parts.username or "") or "default"
    if not _NAME.fullmatch(user):
        raise ValueError(f"Redis user name {user!r} is not letters, digits and . _ -")
    return user, unquote(parts.password)


def users(worker_url: str, client_url: str = "", admin_password: str | None = None) -> list[AclUser]:
    """The users for a workers' and a clients' URL (and an admin for the local stack's own
    management, when ``admin_password`` is given); [] when neither URL has a password."""
    worker = credentials(worker_url)
    client = credentials(client_url) if client_url and client_url != worker_url else None
    if worker is None and client is None:
        return []
    out: list[AclUser] = []
    if worker is not None:
        out.append(AclUser(worker[0], worker[1], WORKER_RULE))
    if client is not None:
        if worker is not None and client[0] == worker[0]:
            raise ValueError(f"the clients' Redis user must differ from the workers' ({client[0]})")
        out.append(AclUser(client[0], client[1], client_rule()))
    if admin_password is not None:
        out.append(AclUser("mmadmin", admin_password, ADMIN_RULE))
    return out


def acl_file(entries: list[AclUser], extra_lines: list[str] = ()) -> str:  # type: ignore[assignment]
    """The ACL file: the default user off unless one of ``entries`` is it, then each user."""
    lines = [] if any(u.name == "default" for u in entries) else ["user default off"]
    lines += [u.line() for u in entries]
    lines += list(extra_lines)
    return "\n".join(lines) + "\n"
