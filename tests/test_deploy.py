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


def test_k8s_containers_use_our_image_commands_env_and_ports() -> None:
    docs = _k8s_docs()
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"} <= kinds
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    secret = next(d for d in docs if d["kind"] == "Secret")
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


def test_dockerfile_installs_the_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for path in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / path).exists(), path
    assert 'ENTRYPOINT ["redis-session"]' in text


@pytest.mark.parametrize("var", ["REDIS_URL", "REDIS_SESSION_PREFIX", "REDIS_SESSION_TOKEN", "REDIS_SESSION_CLUSTER"])
def test_documented_env_vars_are_read(var: str) -> None:
    assert var in PACKAGE_SOURCE
