"""What one engine replica is built from (the deployment's argument; ``ClusterArgs.replica``
hands it over): its engine, the index it publishes to, and its pull, store and move settings."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from kvindex.config import IndexConfig
from replica.config import EngineConfig
from replica.move_config import MoveConfig
from replica.pull_config import PullConfig
from replica.store.config import StoreConfig


class ReplicaArgs(BaseModel):
    """What one engine replica is built from: its engine and the index it publishes to."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = EngineConfig()
    index: IndexConfig = IndexConfig()
    pull: PullConfig = PullConfig()
    store: StoreConfig = StoreConfig()
    moves: MoveConfig = MoveConfig()
