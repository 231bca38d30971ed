"""Wait for a cluster's ``/ready`` and say so once: ``make serve`` runs it beside ``serve
run`` so the terminal shows when the cluster can take requests (and, if it never does in
``--timeout`` seconds, why not). Standard library only; exits 0 when ready, 1 otherwise."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def poll(url: str) -> tuple[int, dict]:
    """``/ready``'s status and body (0 and {} while nothing answers)."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:  # 503 (not ready yet) or 404 (no such app yet)
        try:
            return exc.code, json.load(exc)
        except ValueError:
            return exc.code, {}
    except (OSError, ValueError):
        return 0, {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    deadline, last = time.monotonic() + args.timeout, {}
    while time.monotonic() < deadline:
        status, body = poll(args.url)
        if status == 200:
            print(
                f"\n=== ready: {args.url}/v1 serves {body['model']} on "
                f"{body['engine_replicas']} engine replica(s); index: {body['index']} ===\n",
                flush=True,
            )
            return 0
        last = body or last
        time.sleep(1.0)
    why = last.get("error", {}).get("message", "no answer") if last else "no answer"
    print(f"\n=== not ready after {args.timeout:.0f} s: {why} ===\n", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
