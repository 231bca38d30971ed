"""``python -m replica.store clear``: remove a node's stores that no process has open.

A node store outlives its cluster on purpose: a cluster started again with the same model
file, code and settings starts warm (``replica.store.layout``: the fingerprint decides who
may read a store). To start cold, or to give its memory back, stop the cluster and run this
(``--cluster`` names one cluster's stores: ``replica.store.config.store_namespace``, as
``<index.cluster>.<digest of index.url>``; the default is every cluster's).
"""

from __future__ import annotations

import argparse
import sys

from replica.store.files import remove_cluster_stores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replica.store", description=__doc__)
    parser.add_argument("command", choices=["clear"])
    parser.add_argument("--directory", default="/dev/shm", help="the store's directory")
    parser.add_argument("--cluster", default=None, help="one cluster's namespace only")
    args = parser.parse_args(argv)
    removed = remove_cluster_stores(args.directory, args.cluster)
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} store(s) removed; stores in use are kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
