"""The deployment files parse and reference only what the package has: its image, CLI commands and
options, ports and environment variables. (No container engine runs here, so nothing is started.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml

from redis_session.cli import app

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_SOURCE = "\n".join(p.read_text() for p in (ROOT / "redis_session").rglob("*.py"))


def _click_app() -> Any:
    return typer.main.get_command(app)


def _check_cli_args(args: list[str]) -> None:
    """The command exists and every --option it passes is one of that command's options."""
    group = _click_app()
    cmd = group.commands.get(args[0])
    assert cmd is not None, f"unknown CLI command {args[0]!r}"
    known = {opt for p in cmd.params for opt in getattr(p, "opts", [])}
    for a in args[1:]:
        if a.startswith("--"):
            assert a in known, f"{args[0]}: unknown option {a}"


def _k8s_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for f in sorted((ROOT / "deploy").rglob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def test_kustomization_lists_existing_files() -> None:
    base = ROOT / "deploy" / "base"
    k = yaml.safe_load((base / "kustomization.yaml").read_text())
    for res in k["resources"]:
        assert (base / res).is_file(), res


def _secret_keys() -> set[str]:
    """The keys of the generated secret: the example env file's names (the real file is not in git)."""
    text = (ROOT / "deploy" / "base" / "redis-session.env.example").read_text()
    return {line.split("=", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_k8s_containers_use_our_image_commands_env_and_ports() -> None:
    docs = _k8s_docs()
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    k = yaml.safe_load((ROOT / "deploy" / "base" / "kustomization.yaml").read_text())
    (generated,) = k["secretGenerator"]
    secret = {"metadata": {"name": generated["name"]}, "stringData": dict.fromkeys(_secret_keys(), "")}
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {"projector", "gateway"}
    for d in deployments:
        pod = d["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 10
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        for c in pod["containers"]:
            assert c["image"] == "redis-session"
            _check_cli_args(c["args"])
            for env in c.get("env", []):
                assert env["name"] in PACKAGE_SOURCE, f"env {env['name']} is not read by the package"
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
            for src in c.get("envFrom", []):
                assert src["configMapRef"]["name"] == configmap["metadata"]["name"]
            for port in c.get("ports", []):
                assert str(port["containerPort"]) in PACKAGE_SOURCE + " ".join(c["args"])
    for key in configmap["data"]:
        assert key in PACKAGE_SOURCE, f"ConfigMap key {key} is not read by the package"
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    projector = next(d for d in deployments if d["metadata"]["name"] == "projector")
    assert pdb["spec"]["selector"]["matchLabels"] == projector["spec"]["selector"]["matchLabels"]
    svc = next(d for d in docs if d["kind"] == "Service")
    gateway = next(d for d in deployments if d["metadata"]["name"] == "gateway")
    assert svc["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]
    names = {p["name"] for c in gateway["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names


def test_compose_services() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "projector", "gateway", "demo"} <= services.keys()
    assert services["projector"]["deploy"]["replicas"] == 2
    for name in ("projector", "gateway", "demo"):
        svc = services[name]
        _check_cli_args(svc["command"])
        for var in svc.get("environment", {}):
            assert var in PACKAGE_SOURCE, f"{name}: env {var} is not read by the package"
        assert svc["environment"]["REDIS_URL"].startswith("redis://redis:6379")
    assert services["gateway"]["ports"] == ["8765:8765"]
    assert "ports" not in services["redis"]  # Redis is never published to the host


def test_no_deployment_ships_an_empty_or_placeholder_token() -> None:
    """Compose shipped `REDIS_SESSION_TOKEN: ""` next to `--host 0.0.0.0` (an open
    gateway). Compose now requires the variable (`${VAR:?…}` fails `docker compose up` without it),
    and kustomize generates the secret from an env file that is not in git."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    token = compose["services"]["gateway"]["environment"]["REDIS_SESSION_TOKEN"]
    assert token.startswith("${REDIS_SESSION_TOKEN:?") and token.endswith("}")
    base = ROOT / "deploy" / "base"
    assert not (base / "secret.yaml").exists() and not (base / "redis-session.env").exists()
    assert "redis-session.env" in (base / ".gitignore").read_text().split()
    example = (base / "redis-session.env.example").read_text()
    assert "REDIS_SESSION_TOKEN=\n" in example  # to fill in; the gateway refuses it empty
    for d in _k8s_docs():
        assert d["kind"] != "Secret"


def test_one_image_name_and_tag_with_the_build_step_written_down() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    k = yaml.safe_load((ROOT / "deploy" / "base" / "kustomization.yaml").read_text())
    # the version has one home, redis_session/__init__.py (pyproject reads it: dynamic)
    version = re.search(r'^__version__ = "([^"]+)"', (ROOT / "redis_session" / "__init__.py").read_text(), re.M)
    assert version is not None
    (image,) = k["images"]
    assert (image["name"], image["newName"], image["newTag"]) == ("redis-session", "redis-session", version.group(1))
    for name in ("projector", "gateway", "demo"):
        assert compose["services"][name]["image"] == f"redis-session:{version.group(1)}", name
    build = f"docker build -t redis-session:{version.group(1)} ."
    assert build in (ROOT / "docker-compose.yml").read_text()
    assert build in (ROOT / "deploy" / "base" / "kustomization.yaml").read_text()


def test_probes_split_liveness_from_readiness() -> None:
    """The liveness probe used /healthz, which asked Redis, so a Redis failover
    restarted every gateway pod. Liveness is /healthz (the process), readiness /readyz (Redis)."""
    gateway = next(d for d in _k8s_docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway")
    (c,) = gateway["spec"]["template"]["spec"]["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_gateway_and_projector_connect_as_their_own_redis_users() -> None:
    """One Redis URL (one user) served both, while docs/security.md gives each its own."""
    urls = {}
    for d in _k8s_docs():
        if d["kind"] == "Deployment":
            (c,) = d["spec"]["template"]["spec"]["containers"]
            (env,) = [e for e in c["env"] if e["name"] == "REDIS_URL"]
            urls[d["metadata"]["name"]] = env["valueFrom"]["secretKeyRef"]["key"]
    assert urls == {"gateway": "GATEWAY_REDIS_URL", "projector": "PROJECTOR_REDIS_URL"}
    example = (ROOT / "deploy" / "base" / "redis-session.env.example").read_text()
    doc = (ROOT / "docs" / "security.md").read_text()
    for key, user in (("GATEWAY_REDIS_URL", "gateway"), ("PROJECTOR_REDIS_URL", "projector")):
        assert f"{key}=redis://{user}:" in example
        assert f"ACL SETUSER {user} " in doc


def test_dockerfile_installs_the_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for path in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / path).exists(), path
    assert 'ENTRYPOINT ["redis-session"]' in text


@pytest.mark.parametrize("var", ["REDIS_URL", "REDIS_SESSION_PREFIX", "REDIS_SESSION_TOKEN", "REDIS_SESSION_CLUSTER"])
def test_documented_env_vars_are_read(var: str) -> None:
    assert var in PACKAGE_SOURCE
