"""deploy/k8s: every manifest is valid for Kubernetes (the JSON schemas that
``kubernetes-validate`` bundles, strict: no unknown field), and what the manifests reference
exists: the CLI options they pass, the health port of the config they mount, the config
itself, the volumes, the environment variables, trainguard's exit codes."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.service.deploy.support import (
    DEPLOY,
    parse_cli,
    trainguard_variables,
    variables_read_by_the_code,
)
from trainguard.agent.supervisor._supervisor import EXIT_ABORTED, EXIT_STOPPED
from trainguard.daemon.service._settings import load_daemon_config

MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
# The oldest Kubernetes whose Job API has everything job.yaml uses (podFailurePolicy GA), and
# the newest schemas the validator bundles.
VERSIONS = ("1.31.0", kubernetes_validate.latest_version())


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]


def find(kind: str, name: str) -> dict[str, Any]:
    for path in MANIFESTS:
        for doc in documents(path):
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                found: dict[str, Any] = doc
                return found
    raise AssertionError(f"no {kind} {name} in deploy/k8s")


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name]
    result: dict[str, Any] = found
    return result


def mounted(pod: dict[str, Any], ctr: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume that ``path`` lies in, in container ``ctr`` of ``pod``."""
    mounts = [m for m in ctr["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume of container {ctr['name']}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    result: dict[str, Any] = volume
    return result


def test_the_manifests_exist() -> None:
    assert [p.name for p in MANIFESTS] == ["daemon.yaml", "job.yaml"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_for_kubernetes(path: Path, version: str) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_refuses_what_kubernetes_refuses() -> None:
    deployment = find("Deployment", "trainguard-daemon")
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "three"
    for doc in (unknown, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_every_mount_names_a_volume_and_every_volume_is_used() -> None:
    for path in MANIFESTS:
        for doc in documents(path):
            if doc["kind"] not in ("Deployment", "Job"):
                continue
            pod = doc["spec"]["template"]["spec"]
            volumes = {v["name"] for v in pod["volumes"]}
            used = {
                m["name"]
                for c in pod["containers"] + pod.get("initContainers", [])
                for m in c.get("volumeMounts", [])
            }
            assert used == volumes, doc["metadata"]["name"]


def test_the_daemon_runs_three_instances_ready_on_healthz_of_its_config() -> None:
    deployment = find("Deployment", "trainguard-daemon")
    pod = deployment["spec"]["template"]["spec"]
    daemon = container(pod, "daemon")
    assert deployment["spec"]["replicas"] == 3
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert "requests" in daemon["resources"]

    options = parse_cli("daemon", daemon["args"][1:])
    assert daemon["args"][0] == "daemon"
    config_path = Path(options["config"])
    volume = mounted(pod, daemon, str(config_path))
    config_map = find("ConfigMap", volume["configMap"]["name"])
    text = config_map["data"][config_path.name]
    config = tomllib.loads(text)

    [port] = [
        p for p in daemon["ports"] if p["name"] == daemon["readinessProbe"]["httpGet"]["port"]
    ]
    assert daemon["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert port["containerPort"] == config["service"]["metrics_port"]
    assert config["service"]["metrics_host"] == "0.0.0.0"  # the kubelet probes the pod's IP
    assert daemon["livenessProbe"]["httpGet"]["port"] == port["name"]
    assert daemon["livenessProbe"]["httpGet"]["path"] != "/healthz"  # a standby is alive
    service = find("Service", "trainguard-daemon-metrics")
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]

    # The secrets the config names are files of the right volumes.
    kafka = config["bus"]["security"]
    for key in ("sasl_password_file", "ssl_cafile"):
        assert "secret" in mounted(pod, daemon, kafka[key])
    keys = mounted(pod, daemon, config["security"]["keys_dir"])
    init = container(pod, "keys")
    assert init["command"][-1] == config["security"]["keys_dir"]  # tar -C there
    assert mounted(pod, init, config["security"]["keys_dir"]) == keys
    assert "secret" in mounted(pod, init, init["command"][init["command"].index("-f") + 1])


def test_the_config_map_is_a_valid_daemon_config(tmp_path: Path) -> None:
    config_map = find("ConfigMap", "trainguard-daemon")
    path = tmp_path / "daemon.toml"
    path.write_text(config_map["data"]["daemon.toml"])
    password = tmp_path / "password"
    password.write_text("secret\n")
    settings = load_daemon_config(path, env={"TRAINGUARD_KAFKA_SASL_PASSWORD_FILE": str(password)})
    assert settings.bus.url.startswith("kafka://")  # several instances need Kafka
    assert settings.security.require_auth


def test_the_job_ends_on_trainguards_failed_and_stopped_codes_and_runs_the_supervisor() -> None:
    job = find("Job", "llm-7b")
    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy needs it
    [fail] = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail["onExitCodes"]["operator"] == "In"
    assert {EXIT_ABORTED, EXIT_STOPPED, 2} == set(fail["onExitCodes"]["values"])
    supervisor = container(pod, fail["onExitCodes"]["containerName"])

    args = [a.replace("$(NODE_RANK)", "0") for a in supervisor["args"]]
    assert args[0] == "run"
    options = parse_cli("run", args[1:])
    assert options["nnodes"] == spec["completions"] == spec["parallelism"]
    assert options["command"] == ["python", "train.py"]
    env = {e["name"]: e for e in supervisor["env"]}
    assert "job-completion-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]

    # Rank 0's node is index 0, named through the headless Service of the pods' subdomain.
    service = find("Service", pod["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert options["master_addr"] == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert options["master_port"] in {p["containerPort"] for p in supervisor["ports"]}

    # The files the environment names are on the right volumes.
    for name in ("TRAINGUARD_KAFKA_SASL_PASSWORD_FILE", "TRAINGUARD_DAEMON_PUBLIC_KEYS"):
        assert "secret" in mounted(pod, supervisor, env[name]["value"])
    event_key = env["TRAINGUARD_EVENT_KEY"]["value"]
    init = container(pod, "event-key")
    assert init["command"][-1] == event_key
    assert mounted(pod, init, event_key) == mounted(pod, supervisor, event_key)
    assert "emptyDir" in mounted(pod, supervisor, event_key)
    assert "secret" in mounted(pod, init, init["command"][-2])
    assert "persistentVolumeClaim" in mounted(
        pod, supervisor, env["TRAINGUARD_CHECKPOINT_DIR"]["value"]
    )
    # The node's spool outlives its pod: a folder of its own per index, on the shared volume.
    state = env["XDG_STATE_HOME"]["value"]
    assert "$(NODE_RANK)" in state
    assert list(env).index("XDG_STATE_HOME") > list(env).index("NODE_RANK")  # expanded
    assert "persistentVolumeClaim" in mounted(pod, supervisor, state)
    # A signalled supervisor exits by --stop-timeout, plus up to 2 s to close its connections;
    # its workers get their --grace within it.
    assert pod["terminationGracePeriodSeconds"] > options["stop_timeout"] + 2
    assert options["grace"] < options["stop_timeout"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_variable_the_manifests_set_is_read_by_trainguard(path: Path) -> None:
    assert trainguard_variables(path.read_text()) <= variables_read_by_the_code()


def test_an_option_trainguard_does_not_take_is_caught() -> None:
    with pytest.raises(Exception, match="No such option"):
        parse_cli("run", ["--job=j", "--node-rnak=0", "--", "python"])
