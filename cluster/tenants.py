"""Who a request belongs to: a tenant, a priority and a weight, from its API key.

``api_keys`` lists plain keys (each its own tenant, as before: the tenant is named after a
hash of the key, the name its cache salt always had) or records that name the tenant, its
priority, its weight in the fair queue and its limits. A cluster without keys has one
tenant, ``default``.

Headers (``x-priority``, ``x-tenant``) may change what a request's key says, within what the
key allows: any client may *lower* its own priority (a batch job stepping aside), only a key
with ``trust_headers`` may raise it or name another tenant (a gateway that authenticated its
own users). An untrusted header never raises a priority and is otherwise ignored.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

MAX_PRIORITY = 9
TENANT_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
PRIORITY_HEADER = "x-priority"
TENANT_HEADER = "x-tenant"


class TenantLimits(BaseModel):
    """A tenant's quotas (None: no limit)."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(
        None, gt=0, description="uncached prompt tokens plus output tokens"
    )
    concurrent_requests: int | None = Field(None, gt=0)


class APIKeyRecord(BaseModel):
    """One API key and the tenant it speaks for."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=1)
    tenant: str = Field(pattern=f"^{TENANT_NAME.pattern}$")
    priority: int = Field(0, ge=0, le=MAX_PRIORITY, description="higher leaves the queue first")
    weight: float = Field(1.0, gt=0, le=1000, description="its share inside its priority")
    trust_headers: bool = Field(
        False, description="x-priority may raise the priority, x-tenant name the tenant"
    )
    limits: TenantLimits = Field(default_factory=TenantLimits)
    max_retention_s: float | None = Field(
        None, ge=0, description="the longest its sessions' blocks are kept (None: the cluster's)"
    )


def key_tenant_name(key: str) -> str:
    """The tenant a plain key speaks for: named after its hash (never the key itself)."""
    return "key:" + hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def key_records(keys: Iterable[str | APIKeyRecord]) -> list[APIKeyRecord]:
    """Every key as a record: a plain key is its own tenant at priority 0, weight 1."""
    records = [
        k if isinstance(k, APIKeyRecord) else APIKeyRecord(key=k, tenant=key_tenant_name(k))
        for k in keys
    ]
    if len({r.key for r in records}) != len(records):
        raise ValueError("api_keys: a key is listed twice")
    return records


@dataclass(frozen=True)
class Tenant:
    """What the queue and the quotas need of a request's owner."""

    name: str
    priority: int = 0
    weight: float = 1.0
    limits: TenantLimits = field(default_factory=TenantLimits)
    max_retention_s: float | None = None


DEFAULT = Tenant("default")


class Tenants:
    """The configured keys, by key, and the rule for headers (the module docstring)."""

    def __init__(self, keys: Iterable[str | APIKeyRecord]) -> None:
        self.records = {r.key: r for r in key_records(keys)}
        # tenants configured with different weights or limits on different keys: the first
        self._by_name: dict[str, APIKeyRecord] = {}
        for record in self.records.values():
            self._by_name.setdefault(record.tenant, record)

    def of(self, key: str | None, headers: Mapping[str, str]) -> Tenant:
        """The tenant of a request that authenticated with ``key`` (None: no keys)."""
        record = self.records.get(key or "")
        if record is None:
            return DEFAULT if not self.records else Tenant(key_tenant_name(key or ""))
        name, priority = record.tenant, record.priority
        asked = _priority(headers.get(PRIORITY_HEADER))
        if asked is not None and (asked < priority or record.trust_headers):
            priority = asked
        other = headers.get(TENANT_HEADER, "")
        if record.trust_headers and TENANT_NAME.fullmatch(other):
            # a gateway's user: as configured where the name is, else under the gateway's terms
            name, record = other, self._by_name.get(other, record)
        return Tenant(name, priority, record.weight, record.limits, record.max_retention_s)


def _priority(value: str | None) -> int | None:
    """A header's priority, or None when absent or not a number in range (ignored)."""
    if value is None or not value.strip().isdigit():
        return None
    asked = int(value)
    return asked if 0 <= asked <= MAX_PRIORITY else None


def bearer_key(authorization: str) -> str:
    """The key of an ``Authorization: Bearer <key>`` header ('' when there is none)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
