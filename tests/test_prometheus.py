"""Monitoring with a real Prometheus: the shipped config, rules and dashboard.

- `promtool check config` / `check rules` / `test rules` on the files in deploy/prometheus.
- Every PromQL expression in the Grafana dashboard parses (promtool), and every `agora_*`
  metric the dashboard and alerts use is one that node or coordinator code exports.
- A real coordinator, scraped by a real `prometheus` started from a config generated out
  of the shipped deploy/prometheus/prometheus.yml: series for peers per stage and leases
  appear, and peers announced to the coordinator show up as targets through the
  coordinator-written file-SD JSON.
- With two real `agora-node` processes: tokens and loss series from the nodes.
- Series cardinality stays bounded while 1,000 peers join, heartbeat, leave or lapse.

Only the absence of the `prometheus`/`promtool` binaries (Debian package `prometheus`)
skips the Prometheus tests.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from node.control_tls import connect
from protocol.control import (
    HeartbeatRequest,
    JoinRequest,
    LeaveRequest,
    StatusReply,
    StatusRequest,
)
from protocol.framing import FrameDecoder, frame_message
from protocol.identity import NodeKey
from protocol.message import Message
from protocol.signing import sign_request
from swarmlab.coordinator import start_coordinator
from swarmlab.procs import free_port
from swarmlab.procs import wait_for as _wait_for

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
PROM_DIR = DEPLOY / "prometheus"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="the prometheus and promtool binaries are not installed "
    "(Debian: apt-get install -y prometheus; see deploy/ci-prometheus.sh)",
)
WAIT_S = 40.0  # seconds any single wait in this file may take
# every wait of this file: up to WAIT_S unless given, polling five times a second
wait_for = functools.partial(_wait_for, timeout_s=WAIT_S, poll_s=0.2)


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def try_get(url: str) -> bytes | None:
    try:
        return http_get(url, timeout=2.0)
    except OSError:
        return None


# --- processes -----------------------------------------------------------------------------


class Coordinator:
    """The coordinator under test (swarmlab's launcher) with metrics and a file-SD JSON."""

    def __init__(self, tmp: Path, extra: list[str]) -> None:
        self.sd_file = tmp / "nodes.json"
        self.proc = start_coordinator(
            tmp, config=None, db=tmp / "coordinator.sqlite", metrics=True,
            args=["--prometheus-sd", str(self.sd_file), "--sync", "normal", *extra],
        )  # fmt: skip
        self.port = self.proc.port
        self.metrics_port = self.proc.metrics_port

    def metrics_text(self) -> str:
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics").decode()

    def stop(self) -> None:
        self.proc.stop(timeout_s=15)


def prometheus_config(tmp: Path, coordinator_target: str, sd_file: Path) -> Path:
    """The shipped prometheus.yml with targets, paths and intervals rewritten for `tmp`."""
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(PROM_DIR / f) for f in cfg["rule_files"]]
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert set(jobs) == {"agora-coordinator", "agora-node"}, sorted(jobs)
    assert len(jobs["agora-coordinator"]["static_configs"]) == 1
    jobs["agora-coordinator"]["static_configs"][0]["targets"] = [coordinator_target]
    assert len(jobs["agora-node"]["file_sd_configs"]) == 1
    jobs["agora-node"]["file_sd_configs"][0].update(files=[str(sd_file)], refresh_interval="1s")
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Prometheus:
    def __init__(self, tmp: Path, config: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "prometheus.log"
        argv = [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._ready, "prometheus to become ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.log.read_text()[-3000:]}")
        return try_get(self.base + "/-/ready") is not None

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        body = json.loads(http_get(url))
        assert body["status"] == "success", body
        return body["data"]

    def series(self, query: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=query)["result"])

    def targets(self, job: str) -> list[dict[str, Any]]:
        active = self.api("targets", state="active")["activeTargets"]
        return [t for t in active if t["labels"].get("job") == job]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


class RawPeer:
    """Speaks the control protocol over one TCP socket (signed frames) as many identities."""

    def __init__(self, port: int) -> None:
        self.sock = connect("127.0.0.1", port, None, timeout_s=10)
        self.decoder = FrameDecoder()
        self.run: str | None = None  # requests are signed for no run until the status says
        status = self.call(NodeKey.generate(), StatusRequest())
        assert isinstance(status, StatusReply), status
        self.run = status.run_id

    def call(self, key: NodeKey, body: Message) -> Message:
        self.sock.sendall(frame_message(sign_request(key, body, now=time.time(), run=self.run)))
        while True:
            data = self.sock.recv(1 << 16)
            if not data:
                raise AssertionError(f"coordinator closed the connection on {body.TYPE}")
            replies = self.decoder.feed_messages(data)
            if replies:
                assert len(replies) == 1, replies
                return replies[0]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator(
        tmp_path,
        ["--shard-tokens", "4096", "--lease-ttl", "2", "--heartbeat-interval", "0.5"],
    )
    try:
        yield c
    finally:
        c.stop()


# --- static checks of the shipped files ------------------------------------------------------


@needs_prometheus
def test_promtool_accepts_config_and_rules() -> None:
    for args in (
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],
    ):
        r = subprocess.run(
            [str(PROMTOOL), *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"


def dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "agora.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    return exprs


@needs_prometheus
def test_dashboard_queries_parse(tmp_path: Path) -> None:
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"agora:dashboard_query_{i}", "expr": e}
                    for i, e in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    r = subprocess.run(
        [str(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, f"a dashboard query does not parse:\n{r.stdout}\n{r.stderr}"


def exported_metric_names() -> set[str]:
    """Every sample name the node and coordinator code can export."""
    from prometheus_client import REGISTRY

    import coordinator.metrics
    import node.metrics
    import node.p2p.metrics  # noqa: F401  (registers on the default registry)

    names: set[str] = set()
    for registry in (REGISTRY, coordinator.metrics.CoordinatorMetrics().registry):
        for family in registry.collect():
            names.add(family.name)
            names.update(s.name for s in family.samples)
            if family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
            if family.type == "counter":
                names.add(family.name + "_total")
    return names


def test_deploy_files_use_only_exported_metrics() -> None:
    used: set[str] = set()
    for expr in dashboard_exprs():
        used.update(re.findall(r"\bagora_[a-z0-9_]+", expr))
    for group in yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            used.update(re.findall(r"\bagora_[a-z0-9_]+", rule["expr"]))
    missing = sorted(used - exported_metric_names())
    assert not missing, f"deploy/ uses metrics that no code exports: {missing}"


def test_compose_mounts_shipped_files() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"coordinator", "node", "prometheus", "grafana"} <= set(services)
    for svc in services.values():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"compose mounts missing {src}"
    run = (DEPLOY / "docker" / "run.toml").read_text()
    prom = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    node_job = next(j for j in prom["scrape_configs"] if j["job_name"] == "agora-node")
    assert f'prometheus_sd = "{node_job["file_sd_configs"][0]["files"][0]}"' in run


# --- a real Prometheus against a real coordinator -------------------------------------------


@needs_prometheus
@pytest.mark.slow
def test_prometheus_scrapes_coordinator_and_discovers_peers(
    tmp_path: Path, coordinator: Coordinator
) -> None:
    # Two peers join with metrics endpoints (and keep heartbeating), so the coordinator
    # lists them in its file SD.
    keys = [NodeKey.generate() for _ in range(2)]
    ports = [free_port(), free_port()]
    raw = RawPeer(coordinator.port)
    stop = threading.Event()
    beating = threading.Thread(target=heartbeats, args=(raw, keys, stop), daemon=True)
    try:
        for stage, (key, port) in enumerate(zip(keys, ports, strict=True)):
            reply = raw.call(key, JoinRequest(stage=stage, metrics_port=port))
            assert reply.TYPE == "join.reply", reply
        beating.start()
        prom = Prometheus(
            tmp_path,
            prometheus_config(
                tmp_path, f"127.0.0.1:{coordinator.metrics_port}", coordinator.sd_file
            ),
        )
        try:
            wait_for(
                lambda: prom.series('up{job="agora-coordinator"} == 1'),
                "up{job=agora-coordinator} == 1",
            )
            peers = wait_for(
                lambda: prom.series("agora_coordinator_peers"), "agora_coordinator_peers series"
            )
            assert {s["metric"]["stage"] for s in peers} == {"0", "1"}
            wait_for(
                lambda: prom.series("sum(agora_coordinator_peers) == 2"),
                "both peers counted per stage",
            )
            wait_for(
                lambda: (
                    prom.series("agora_coordinator_active_leases")
                    and prom.series('agora_coordinator_shards{state="pending"} > 0')
                ),
                "lease series",
            )
            want = {f"127.0.0.1:{p}" for p in ports}

            def discovered() -> bool:
                got = {t["labels"]["instance"]: t["labels"] for t in prom.targets("agora-node")}
                return set(got) == want and {v["stage"] for v in got.values()} == {"0", "1"}

            wait_for(discovered, f"targets {sorted(want)} discovered from the coordinator's file")
            stop.set()
            beating.join(timeout=10)
            for key in keys:
                reply = raw.call(key, LeaveRequest())
                assert reply.TYPE == "ok", reply
            wait_for(
                lambda: not prom.targets("agora-node"), "departed peers removed from the targets"
            )
            rules = wait_for(lambda: _evaluated_rules(prom), "alert rules evaluated")
            bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
            assert not bad, f"alert rules failing to evaluate: {bad}"
        finally:
            prom.stop()
    finally:
        stop.set()
        if beating.is_alive():
            beating.join(timeout=10)
        raw.close()


def heartbeats(raw: RawPeer, keys: list[NodeKey], stop: threading.Event) -> None:
    while not stop.wait(0.4):
        for key in keys:
            reply = raw.call(key, HeartbeatRequest())
            assert reply.TYPE == "heartbeat.reply", reply


def _evaluated_rules(prom: Prometheus) -> list[dict[str, Any]] | None:
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    return rules if rules and all(r["health"] != "unknown" for r in rules) else None


def heartbeat_and_leave(raw: RawPeer, key: NodeKey) -> None:
    reply = raw.call(key, HeartbeatRequest())
    assert reply.TYPE == "heartbeat.reply", reply
    reply = raw.call(key, LeaveRequest())
    assert reply.TYPE == "ok", reply


# --- cardinality ----------------------------------------------------------------------------


def series_of(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.slow
def test_series_stay_bounded_as_1000_peers_come_and_go(coordinator: Coordinator) -> None:
    raw = RawPeer(coordinator.port)
    seen_ids: list[str] = []
    counts: list[int] = []
    try:
        for batch in range(10):  # 10 x 100 peers: join (+ heartbeat), then leave or lapse
            keys = [NodeKey.generate() for _ in range(100)]

            def keep_alive(joined: list[NodeKey]) -> None:
                # The TTL is 2 s: on a loaded machine 100 joins take longer than that.
                for k in joined:
                    reply = raw.call(k, HeartbeatRequest())
                    assert reply.TYPE == "heartbeat.reply", reply

            for i, key in enumerate(keys):
                reply = raw.call(key, JoinRequest(metrics_port=20000 + batch * 100 + i))
                assert reply.TYPE == "join.reply", reply
                seen_ids.append(key.peer_id)
                if i % 20 == 19:
                    keep_alive(keys[: i + 1])

            def listed(keys: list[NodeKey] = keys) -> bool:
                keep_alive(keys)
                return coordinator.sd_file.exists() and (
                    sum(len(g["targets"]) for g in json.loads(coordinator.sd_file.read_text()))
                    == 100
                )

            wait_for(listed, "100 peers in the file SD")
            for i, key in enumerate(keys):
                if batch % 2 == 0 or i % 2 == 0:  # the rest lapse past the 2 s TTL
                    heartbeat_and_leave(raw, key)
            wait_for(
                lambda: (
                    'agora_coordinator_peers{stage="0"} 0.0' in coordinator.metrics_text()
                    and 'agora_coordinator_peers{stage="1"} 0.0' in coordinator.metrics_text()
                ),
                "every peer of the batch gone",
            )
            counts.append(len(series_of(coordinator.metrics_text())))
    finally:
        raw.close()
    text = coordinator.metrics_text()
    assert "agora_coordinator_joins_total 1000.0" in text
    assert re.search(r'agora_coordinator_leaves_total\{reason="dead"\} [1-9]', text), text
    for pid in seen_ids:
        assert pid not in text, "a peer id appears in the coordinator's metrics"
    assert json.loads(coordinator.sd_file.read_text()) == []
    # The series set stops growing once every label value has been seen once.
    assert counts[-1] == counts[2], counts
    assert counts[-1] < 300, counts


# --- a real Prometheus against real nodes ----------------------------------------------------


@needs_prometheus
@pytest.mark.slow
def test_prometheus_scrapes_training_nodes(tmp_path: Path) -> None:
    """Two real agora-node processes (stage 0 and 1) are discovered through the
    coordinator's file SD, and their tokens and loss series reach Prometheus."""
    from swarmlab.swarm import LocalSwarm

    sd_file = tmp_path / "nodes.json"
    swarm = LocalSwarm(
        workdir=tmp_path / "swarm",
        preset="tiny",
        metrics=True,
        coordinator_args=["--prometheus-sd", str(sd_file)],
        node_args=["--outer-every-steps", "0"],
    )
    try:
        swarm.start_coordinator()
        assert swarm.coordinator is not None
        metrics_port = swarm.coordinator.metrics_port
        nodes = [swarm.add_node("s0", 0), swarm.add_node("s1", 1)]
        prom = Prometheus(
            tmp_path, prometheus_config(tmp_path, f"127.0.0.1:{metrics_port}", sd_file)
        )
        try:
            want = {f"127.0.0.1:{n.metrics_port}" for n in nodes}

            def healthy() -> bool:
                up = {
                    t["labels"]["instance"]
                    for t in prom.targets("agora-node")
                    if t["health"] == "up"
                }
                return up == want

            wait_for(healthy, f"both nodes {sorted(want)} up as targets", timeout_s=120)
            wait_for(
                lambda: len(prom.series("agora_node_tokens_total > 0")) == 2,
                "tokens series from both nodes",
                timeout_s=120,
            )
            wait_for(lambda: prom.series("agora_node_loss > 0"), "a loss series", timeout_s=60)

            def stages() -> bool:
                peers = prom.series("agora_coordinator_peers > 0")
                return {s["metric"]["stage"] for s in peers} == {"0", "1"}

            wait_for(stages, "the coordinator's peers on stages 0 and 1")
        finally:
            prom.stop()
        codes = swarm.stop()
        assert codes == {"s0": 0, "s1": 0, "coordinator": 0}, codes
    finally:
        swarm.kill_all()
