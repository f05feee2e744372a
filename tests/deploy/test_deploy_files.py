"""deploy/: the Dockerfile (hadolint), the shell scripts (ShellCheck), the Prometheus config
(promtool) and the Serve config (Ray Serve's own schema, then raypaged's argument model)."""
from __future__ import annotations

import os
import re
import subprocess

import yaml

from deploy_tools import ROOT, run
from raypaged.serve.config import ServeArgs

DOCKERFILE = ROOT / "deploy/Dockerfile"


def test_hadolint_accepts_the_dockerfile():
    run("hadolint", str(DOCKERFILE))


def test_the_image_takes_torch_from_the_cpu_index_unless_told_otherwise():
    # PyPI's torch is the multi-GB CUDA build; the CPU image must never pull it.
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    install = re.search(r'pip install --no-cache-dir --index-url "\$\{TORCH_INDEX_URL\}" '
                        r'"torch==\$\{TORCH_VERSION\}"', text)
    assert install and text.index(install.group()) < text.index("pip install --no-cache-dir .")
    # The converted default model is found whatever HOME the container runs with.
    assert re.search(r"^ENV RAYPAGED_CACHE=/opt/raypaged/cache$", text, re.M)


def test_shellcheck_accepts_the_scripts():
    run("shellcheck", str(ROOT / "deploy/ray_job_submit.sh"),
        str(ROOT / "tests/deploy/tools/install.sh"))


def test_promtool_accepts_the_prometheus_config():
    out = run("promtool", "check", "config", str(ROOT / "deploy/prometheus.yml"))
    assert "SUCCESS" in out.stdout + out.stderr


def test_the_serve_config_is_valid_for_ray_serve_and_for_raypaged():
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "deploy/serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "raypaged.serve.app:build_app"
    options, _ = ServeArgs(**app["args"]).split()  # unknown keys or bad values raise here
    assert options.app_name == app["name"]


def submitted_by_the_script(tmp_path, **env) -> list[str]:
    """The `ray job submit` command line deploy/ray_job_submit.sh runs in serve mode, read from a
    stand-in `ray` first on PATH that writes down its arguments."""
    args_file = tmp_path / "args"
    fake = tmp_path / "bin/ray"
    fake.parent.mkdir(parents=True)
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {args_file}\n')
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("HOST", "RAYPAGED_API_KEY")}
    subprocess.run(["bash", str(ROOT / "deploy/ray_job_submit.sh")], cwd=ROOT, check=True,
                   env={**base, "PATH": f"{fake.parent}:{os.environ['PATH']}", **env},
                   timeout=60)
    return args_file.read_text().splitlines()


def test_the_job_script_never_sends_the_api_key_with_the_job(tmp_path):
    # A job's runtime_env and entrypoint are shown to anyone who can read the Jobs API; the key
    # reaches the job through the environment of the cluster's nodes instead.
    args = submitted_by_the_script(tmp_path, RAYPAGED_API_KEY="s3cret-key")
    assert args[:2] == ["job", "submit"]
    assert not any("s3cret-key" in a or "RAYPAGED_API_KEY" in a for a in args)
    assert "--runtime-env-json" not in args and "--runtime-env" not in args


def test_the_job_script_serves_on_loopback_unless_told_otherwise(tmp_path):
    args = submitted_by_the_script(tmp_path)
    assert args[args.index("--host") + 1] == "127.0.0.1"
    args = submitted_by_the_script(tmp_path / "wide", HOST="0.0.0.0")
    assert args[args.index("--host") + 1] == "0.0.0.0"
