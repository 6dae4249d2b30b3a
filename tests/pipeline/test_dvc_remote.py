"""A team's DVC remote: push a tiny-target run to a real local S3 server, clone fresh, pull it back.

The S3 server is moto's server mode (`moto[server]`, in the `test` extra), started as a subprocess on
a free localhost port; DVC talks to it through its own S3 support (`dvc[s3]`), exactly as it would
talk to AWS, MinIO or Ceph. The remote's URL is committed; its endpoint and the credentials are not:
the endpoint goes to `.dvc/config.local` (`dvc remote modify --local`), the credentials come from
the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), as the README's team setup says.
"""

import hashlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support.helpers import folder_bytes, run, set_params, stage_env

pytestmark = [pytest.mark.slow, pytest.mark.dvc]  # test lanes (pyproject.toml)

ACCESS_KEY = "AKIATESTTEAMREMOTE01"
SECRET_KEY = "team-remote-secret-never-in-git-0123456789"
BUCKET = "dflash-team"
# Every cached output of the pipeline: what `dvc push` sends and `dvc pull` must bring back.
CACHED_OUTPUTS = ("data/target", "data/generated", "data/hidden", "data/checkpoints", "data/eval", "data/export/drafter")


def missing(message: str) -> None:
    """Skip a test whose optional dependency is absent, except under CI=true, where it must fail."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def s3_endpoint(tmp_path):
    """A moto S3 server on a free localhost port, holding one empty bucket; yields its URL."""
    for module, package in (("moto", "moto[server]"), ("flask", "moto[server]"), ("dvc_s3", "dvc[s3]"), ("boto3", "boto3")):
        if importlib.util.find_spec(module) is None:
            missing(f"{package} is not installed: `pip install -e '.[test]'` (make install does)")
    port = free_port()
    log = open(tmp_path / "moto.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert server.poll() is None, f"moto server exited:\n{(tmp_path / 'moto.log').read_text()}"
            try:
                urllib.request.urlopen(endpoint + "/", timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise AssertionError(f"moto server did not answer on {endpoint} within 60 s")
                time.sleep(0.2)
        import boto3

        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def team_env(home: Path) -> dict:
    """The stage environment plus the team's S3 credentials, and no AWS config from this machine's home."""
    env = stage_env()
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1",
               AWS_CONFIG_FILE=str(home / "aws-config"), AWS_SHARED_CREDENTIALS_FILE=str(home / "aws-credentials"),
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env


def dvc(repo: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run(["dvc", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def test_a_pushed_run_pulled_into_a_fresh_clone_needs_no_recompute(reproduced_tiny_pipeline, s3_endpoint, tmp_path):
    repo = reproduced_tiny_pipeline  # the tiny run, committed
    env = team_env(tmp_path)
    assert dvc(repo, "status", env=env).stdout.strip().endswith("Data and pipelines are up to date.")

    # The team's remote: its URL is committed, its endpoint stays local, its credentials stay in the environment.
    dvc(repo, "remote", "add", "-d", "team", f"s3://{BUCKET}/runs", env=env)
    dvc(repo, "remote", "modify", "--local", "team", "endpointurl", s3_endpoint, env=env)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "tiny run"], repo)
    committed = run(["git", "ls-files"], repo).stdout.split()
    assert ".dvc/config" in committed and ".dvc/config.local" not in committed
    assert f"s3://{BUCKET}/runs" in (repo / ".dvc" / "config").read_text()
    for name in committed:
        text = (repo / name).read_bytes()
        assert SECRET_KEY.encode() not in text and ACCESS_KEY.encode() not in text, f"a credential is in {name}"
        assert s3_endpoint.encode() not in text, f"the local endpoint is in {name}"

    pushed = dvc(repo, "push", env=env)
    assert "pushed" in pushed.stdout

    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    dvc(clone, "remote", "modify", "--local", "team", "endpointurl", s3_endpoint, env=env)
    dvc(clone, "pull", env=env)
    for output in CACHED_OUTPUTS:
        assert folder_bytes(clone / output) == folder_bytes(repo / output) != {}, f"{output} differs after dvc pull"

    # Every stage's outputs, data/target included, came from the remote: nothing is stale, nothing reruns.
    assert dvc(clone, "status", env=env).stdout.strip().endswith("Data and pipelines are up to date.")
    assert (clone / "data/target/target.json").read_bytes() == (repo / "data/target/target.json").read_bytes()
    assert "Running stage" not in dvc(clone, "repro", env=env).stdout
    metrics = sorted(path.name for path in (repo / "data" / "metrics").glob("*.json"))
    assert metrics == ["capture.json", "eval.json", "generate.json", "train.json"]
    for name in metrics:
        assert (clone / "data/metrics" / name).read_bytes() == (repo / "data/metrics" / name).read_bytes(), name
    assert run(["git", "status", "--porcelain"], clone).stdout == ""


def cache_files(repo: Path) -> list[Path]:
    return [path for path in (repo / ".dvc" / "cache" / "files" / "md5").rglob("*") if path.is_file()]


def test_the_committed_link_type_stores_each_output_once_and_protects_the_cache(reproduced_tiny_pipeline):
    """`.dvc/config` puts hardlink first: a freshly committed output becomes a read-only hard link to
    its cache file (one copy on disk, not two). Rerunning stages, one whose output DVC deletes first
    (capture) and one whose persisted output it unprotects (train resumes from its checkpoints),
    leaves every cache file equal to its hash: the writers replace files by rename, never in place."""
    repo = reproduced_tiny_pipeline  # a copy of the run as `dvc repro` left it (cp -a keeps its hard links)
    env = stage_env()
    cached = {path.stat().st_ino: path for path in cache_files(repo)}
    outputs = [path for name in ("data/hidden", "data/checkpoints", "data/eval") for path in (repo / name).rglob("*") if path.is_file()]
    assert len(outputs) > 10
    for path in outputs:
        info = path.stat()
        assert info.st_ino in cached, f"{path} is a second copy, not a link to the DVC cache"
        assert info.st_mode & 0o222 == 0, f"{path} is writable: an edit would go straight into the cache"

    set_params(repo, capture={"batch_tokens": 4096}, train={"max_steps": 6})
    rerun = dvc(repo, "repro", env=env).stdout
    assert "Running stage 'capture'" in rerun and "Running stage 'train'" in rerun
    assert (repo / "data/checkpoints/step_000006").is_dir()
    for path in cache_files(repo):
        digest = hashlib.md5(path.read_bytes()).hexdigest()
        name = path.parent.name + path.name.removesuffix(".dir")
        assert digest == name, f"cache file {path} no longer holds the bytes of its hash"
    # A rerun that reproduces a file byte for byte leaves it as a second copy: DVC links only objects
    # new to the cache (treeverse/dvc#10549). `make repro` ends with the relink that frees that space.
    rerun_outputs = [path for name in ("data/hidden", "data/checkpoints") for path in (repo / name).rglob("*") if path.is_file()]
    dvc(repo, "checkout", "--relink", env=env)
    cached = {path.stat().st_ino for path in cache_files(repo)}
    for path in rerun_outputs:
        assert path.stat().st_ino in cached and path.stat().st_mode & 0o222 == 0, f"{path} is not a read-only link to the cache"
    assert dvc(repo, "status", env=env).stdout.strip().endswith("Data and pipelines are up to date.")
