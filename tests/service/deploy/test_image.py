"""deploy/Dockerfile, parsed (``dockerfile-parse``): it installs trainguard from this
repository, runs ``trainguard`` under tini as a non-root user, optionally with the CPU build of
the torch version CI tests, and exposes the daemon's health port."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import tomllib

import pytest
from dockerfile_parse import DockerfileParser

from tests.service.deploy.support import DEPLOY, REPO, parse_cli
from trainguard.daemon.service._settings import DaemonConfig

DOCKERFILE = DEPLOY / "Dockerfile"


@pytest.fixture(scope="module")
def image() -> DockerfileParser:
    return DockerfileParser(str(DOCKERFILE))


def instructions(image: DockerfileParser, name: str) -> list[str]:
    return [i["value"] for i in image.structure if i["instruction"] == name]


def test_the_entrypoint_is_trainguard_under_tini(image: DockerfileParser) -> None:
    [entrypoint] = instructions(image, "ENTRYPOINT")
    argv = json.loads(entrypoint)
    assert argv[0] == "/usr/bin/tini"
    assert argv[1:] == ["--", "trainguard"]
    assert any("install" in r and "tini" in r.split() for r in instructions(image, "RUN"))
    [cmd] = instructions(image, "CMD")
    command, *args = json.loads(cmd)
    parse_cli(command, args)


def test_it_runs_as_the_non_root_user_the_manifests_name(image: DockerfileParser) -> None:
    [user] = instructions(image, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit()  # numeric: runAsNonRoot can check it
    assert int(uid) != 0
    manifests = "".join(p.read_text() for p in (DEPLOY / "k8s").glob("*.yaml"))
    assert set(re.findall(r"runAsUser: (\d+)", manifests)) == {uid}
    assert set(re.findall(r"runAsGroup: (\d+)", manifests)) == {gid}


def test_it_installs_this_repository_and_torch_only_on_request(image: DockerfileParser) -> None:
    for copy in instructions(image, "COPY"):
        *sources, _ = shlex.split(copy)
        for source in sources:
            assert (REPO / source).exists(), source
    assert image.args["TORCH"] == "none"
    ci = (REPO / ".ci" / "run").read_text()
    [pin] = re.findall(r'TORCH_PIN="torch==([^"]+)"', ci)
    assert image.args["TORCH_VERSION"] == pin  # the torch CI tests with
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for copy in instructions(image, "COPY"):
        for source in shlex.split(copy)[:-1]:
            assert f"!{source}" in ignore, f"{source} is not in the build context"


def test_it_exposes_the_daemons_health_port(image: DockerfileParser) -> None:
    [expose] = instructions(image, "EXPOSE")
    [default] = [f.default for f in dataclasses.fields(DaemonConfig) if f.name == "metrics_port"]
    assert int(expose) == default


def test_the_manifests_run_this_projects_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    manifests = "".join(p.read_text() for p in (DEPLOY / "k8s").glob("*.yaml"))
    tags = set(re.findall(r"image: trainguard:(\S+)", manifests))
    assert tags == {version, f"{version}-cpu"}
