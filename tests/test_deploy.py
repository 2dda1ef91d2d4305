"""deploy/compose.yaml is safe by default: a closed run whose join token is a secret file,
no Prometheus lifecycle API, no default Grafana password, and Prometheus and Grafana
bound to 127.0.0.1. The shipped run.toml loads as a coordinator config in token mode."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import yaml

from coordinator.config import load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())  # type: ignore[no-any-return]


def test_compose_holds_no_secret_and_publishes_only_the_coordinator() -> None:
    services = compose()["services"]
    text = (DEPLOY / "compose.yaml").read_text()
    assert "enable-lifecycle" not in text and "enable-admin-api" not in text
    grafana = services["grafana"]
    env = grafana["environment"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env, "a password in the compose file"
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert "grafana_admin_password" in grafana["secrets"]
    for name, svc in services.items():
        for port in svc.get("ports", []):
            if name != "coordinator":
                assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} to all"
        assert not any("token" in str(a) and "=" in str(a) and "file" not in str(a)
                       for a in svc.get("command", [])), f"{name}: a token on a command line"  # fmt: skip
        assert not any("TOKEN" in k for k in svc.get("environment", {})), name
    node = services["node"]
    assert "--join-token-file=/run/secrets/join_token" in node["command"]
    assert "join_token" in node["secrets"] and "join_token" in services["coordinator"]["secrets"]
    for secret in compose()["secrets"].values():
        assert secret["file"].startswith("./secrets/")


def test_the_secrets_folder_is_never_committed() -> None:
    ignore = (DEPLOY / "secrets" / ".gitignore").read_text().splitlines()
    assert "*" in ignore
    probe = DEPLOY / "secrets" / "join_token"
    out = subprocess.run(
        ["git", "check-ignore", "-q", str(probe)], cwd=DEPLOY, capture_output=True, timeout=30
    )
    assert out.returncode == 0, "deploy/secrets/join_token would be committed"


def test_the_shipped_run_config_is_a_closed_run(tmp_path: Path) -> None:
    raw = tomllib.loads((DEPLOY / "docker" / "run.toml").read_text())
    assert raw["auth"] == "token" and "join_token" not in raw
    assert raw["join_token_file"] == "/run/secrets/join_token"
    token = tmp_path / "join_token"
    token.write_text("a" * 64 + "\n")
    run = tmp_path / "run.toml"
    run.write_text(
        (DEPLOY / "docker" / "run.toml").read_text().replace("/run/secrets/join_token", str(token))
    )
    cfg = load_config(run, {})
    assert cfg.auth == "token" and cfg.join_token == "a" * 64
    assert "a" * 64 not in repr(cfg)
