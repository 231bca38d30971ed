"""A real Prometheus for tests and benchmarks: Debian's ``/usr/bin/prometheus`` scraping the
cluster's ``/metrics``, with its own config, storage and port in a temporary directory, read
through its HTTP API. ``promtool`` runs Prometheus's own checks (config, rules, rule tests).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from bench.harness.redis_server import free_port

JOB = "prefix-serve"


def binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/bin")
    if found is None:
        raise RuntimeError(
            f"{name} not found: install Debian's prometheus (scripts/ensure-system.sh test)"
        )
    return found


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``promtool ARGS...``, its output captured (the caller checks ``returncode``)."""
    return subprocess.run(
        [binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def scrape_config(
    targets: Sequence[str],
    token_file: Path | None,
    scrape_interval_s: float,
    rule_files: Sequence[Path],
) -> dict[str, Any]:
    """The config Prometheus runs with: one job scraping ``targets``' ``/metrics``."""
    interval = f"{int(scrape_interval_s * 1000)}ms"
    job: dict[str, Any] = {
        "job_name": JOB,
        "metrics_path": "/metrics",
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "static_configs": [{"targets": list(targets)}],
    }
    if token_file is not None:
        job["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(Path(p).resolve()) for p in rule_files],
        "scrape_configs": [job],
    }


class PrometheusServer:
    """One Prometheus process, on a free loopback port, scraping ``targets`` (host:port)."""

    def __init__(
        self,
        targets: Sequence[str],
        bearer_token: str | None = None,
        scrape_interval_s: float = 1.0,
        rule_files: Sequence[str | Path] = (),
    ) -> None:
        self.binary = binary("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.scrape_interval_s = scrape_interval_s
        self._dir = Path(tempfile.mkdtemp(prefix="prometheus-"))
        token_file = None
        if bearer_token is not None:
            token_file = self._dir / "token"
            token_file.write_text(bearer_token)
            token_file.chmod(0o600)
        config = scrape_config(
            targets, token_file, scrape_interval_s, [Path(p) for p in rule_files]
        )
        self.config_path = self._dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = self._dir / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._http = httpx.Client(base_url=self.url, timeout=10)

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        args = [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self._dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait(lambda: self._http.get("/-/ready").status_code == 200, timeout_s, "ready")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, done: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self._proc.returncode}): {self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if done():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not {what} after {timeout_s} s: {self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def api(self, path: str, **params: Any) -> Any:
        """``GET /api/v1/<path>``'s ``data`` (raises on an error answer)."""
        answer = self._http.get(f"/api/v1/{path}", params=params).json()
        if answer.get("status") != "success":
            raise RuntimeError(f"prometheus /api/v1/{path} {params}: {answer}")
        return answer["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result: ``[{"metric": {...}, "value": [t, "v"]}, ...]`` (a
        scalar or string result as one entry without labels)."""
        data = self.api("query", query=promql)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def value(self, promql: str) -> float | None:
        """The one value of an instant query (None: no result)."""
        result = self.query(promql)
        if not result:
            return None
        if len(result) > 1:
            raise ValueError(f"{promql} has {len(result)} series, not one")
        return float(result[0]["value"][1])

    def wait_for_scrape(self, timeout_s: float = 30.0, after: float | None = None) -> None:
        """Until every target is up (``up == 1``), from a scrape started after ``after``
        (Unix time; None: any scrape)."""
        since = after if after is not None else 0.0

        def scraped() -> bool:
            ups = self.query(f'up{{job="{JOB}"}}')
            if not ups or any(u["value"][1] != "1" for u in ups):
                return False
            times = self.query(f'timestamp(up{{job="{JOB}"}})')
            return all(float(t["value"][1]) > since for t in times)

        self._wait(scraped, timeout_s, "scraped")

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule (``/api/v1/rules``), each with its group's ``file``."""
        groups = self.api("rules")["groups"]
        return [{**rule, "file": group["file"]} for group in groups for rule in group["rules"]]

    def stop(self) -> None:
        """Stop Prometheus (SIGTERM, then SIGKILL) and remove its directory."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._http.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
