"""A replica's second cache tier, from its config: the node's store file (swept of stores
nobody can use), the disk tier if set. Any failure leaves the replica without a tier
(logged), never without service."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvindex.config import IndexConfig
from replica.store.config import StoreConfig, store_namespace
from replica.store.disk import DiskTier
from replica.store.files import open_node_store, sweep
from replica.store.layout import file_name, fingerprint
from replica.store.node_store import StoreGeometry
from replica.store.tier import StoreTier

if TYPE_CHECKING:
    from replica.engine.engine import Engine

log = logging.getLogger("ray.serve")


def build_tier(
    engine: Engine, kv_source: str, config: StoreConfig, index: IndexConfig
) -> StoreTier | None:
    """The tier for ``engine`` (its KV layout, model, block size, secret, and ``kv_source``:
    what computes its blocks, ``ModelRunner.kv_source``), or None."""
    kv = engine.kv
    if not config.enabled or kv is None or kv.cache is None:
        return None
    hasher = engine.hasher
    print_ = fingerprint(hasher.model_id, hasher.block_size, hasher.secret, kv.layout, kv_source)
    namespace = store_namespace(index)
    block_bytes = kv.pool.data[0].nbytes
    try:
        sweep(config.directory, namespace, print_, config.stale_after_s)
        geometry = StoreGeometry.for_bytes(
            config.size_bytes(), hasher.block_size, block_bytes, config.ways
        )
        store = open_node_store(config.directory, namespace, print_, geometry)
        disk = None
        if config.disk_directory is not None:
            name = file_name(namespace, print_)
            disk = DiskTier(
                config.disk_directory, name, print_, hasher.block_size, block_bytes,
                config.disk_bytes,
            )  # fmt: skip
    except OSError as exc:
        log.warning("no node store (%s): serving without the second cache tier", exc)
        return None
    return StoreTier(store, disk, config.disk_after_uses)
