"""What DVC costs on big shard folders: hashing, no-op status and repro, push/pull, disk, protection.

Synthetic shards of a few GB are written by the real writer (`shards.ShardWriter`, with a real
manifest, so `verify_split` checks them) as the one stage of a throwaway git + DVC repo, then:

- `first hash`: `dvc status` with DVC's state database removed and the page cache dropped, i.e.
  what a fresh clone or another machine pays to learn the workspace's hashes (disk-bound);
- `commit`: `dvc commit` after `dvc repro --no-commit` ran the writer: moving the shards into the
  cache and linking them back;
- a no-op `dvc status` and `dvc repro` (state database warm);
- `dvc push` to a local S3 server (moto, the same as tests/pipeline/test_dvc_remote.py) and `dvc pull` into a
  fresh clone with an empty cache;
- `dvc checkout` of the whole folder after deleting it (switching experiments), `dvc unprotect`
  (what `dvc repro` does to a persisted output before rerunning its stage);
- the disk that workspace + cache take (a hard-linked file counted once), and whether the
  workspace file of a cached shard is read-only (no write bit: its owner's editor or script is
  refused; root is not, so `dvc unprotect` before editing by hand).

Each shard size runs with the committed link types (`.dvc/config`: hardlink, copy); the default
shard size also runs with DVC's usual `reflink,copy` order (reflink first; on a filesystem without
reflinks, ext4, every freshly committed output then stays in the workspace as a second copy),
`symlink,copy` and `copy`. Ratios are printed
against the committed default (hardlink, capture.shard_mb=256), measured side by side in one run.

    python bench/studies/dvc_costs.py --gb 3 --json bench/results/dvc_costs.json
    python bench/studies/dvc_costs.py --dry-run    # one row of 2 MB, page cache kept (tests/bench/test_dry_runs.py)
"""

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "src"))

# SmolLM2-135M's default capture: 5 taps x hidden 576 in bf16, plus the target's top-32.
FEATURE_WIDTH = 5 * 576
TOP_K = 32
COMMITTED_LINK_TYPES = "hardlink,copy"  # .dvc/config
BUCKET = "dvc-costs"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIABENCHDVCCOSTS001", "AWS_SECRET_ACCESS_KEY": "bench-secret",
               "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def write_synthetic_split(folder: Path, *, total_bytes: int, shard_mb: int, seed: int) -> dict:
    """A `train` split of random features through the real writer, planned like capture plans shards."""
    import torch

    from dflash_pipeline.data.shards import Manifest, ShardWriter, bytes_per_token

    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    token_bytes = bytes_per_token(FEATURE_WIDTH, "bf16", TOP_K)
    split = folder / "train"
    split.mkdir(parents=True, exist_ok=True)
    shards, writer, written, sequences, tokens, loss_tokens = [], None, 0, 0, 0, 0
    start = time.perf_counter()
    while written < total_bytes:
        length = int(rng.integers(256, 2049))
        if writer is None or writer.tokens and (writer.tokens + length) * token_bytes > shard_mb << 20:
            if writer is not None:
                shards.append(writer.close())
            writer = ShardWriter(split / f"shard-{len(shards):05d}.arrow", feature_dtype="bf16",
                                 feature_width=FEATURE_WIDTH, top_k=TOP_K)
        ids = rng.integers(0, 49152, length, dtype=np.int32)
        mask = (np.arange(length) >= length // 4).astype(np.uint8)
        writer.write(f"seq-{sequences:06d}", ids, mask, np.roll(ids, -1),
                     torch.randn(length, FEATURE_WIDTH, generator=generator),
                     rng.integers(0, 49152, (length, TOP_K), dtype=np.int32),
                     -rng.random((length, TOP_K), dtype=np.float32) * 10)
        sequences, tokens, loss_tokens = sequences + 1, tokens + length, loss_tokens + int(mask.sum())
        written += length * token_bytes
    shards.append(writer.close())
    Manifest(split="train", target_fingerprint="synthetic", layer_ids=[1, 7, 13, 19, 25], hidden_size=576,
             num_target_layers=30, feature_dtype="bf16", feature_width=FEATURE_WIDTH, sequences=sequences,
             tokens=tokens, loss_tokens=loss_tokens, shards=shards, target_top_k=TOP_K).save(split)
    for record in split.glob("*.sha256"):
        record.unlink()
    return {"seconds": time.perf_counter() - start, "shards": len(shards), "bytes": sum(s.bytes for s in shards)}


def write_small_files(folder: Path, *, count: int) -> dict:
    """`count` files of 4 KiB: what DVC pays per file, apart from bytes (status, hashing, requests)."""
    split = folder / "train"
    split.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for number in range(count):
        (split / f"file-{number:06d}.bin").write_bytes(rng.bytes(4096))
    return {"seconds": time.perf_counter() - start, "shards": count, "bytes": count * 4096}


def timed(cmd: list[str], cwd: Path, env: dict) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{result.stdout}\n{result.stderr}")
    return time.perf_counter() - start


def drop_page_cache() -> bool:
    """Make the next read come from disk, as it would for a TB-sized folder; needs root."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def disk_kib(*paths: Path) -> int:
    """Blocks in use under all `paths` together; du counts a hard-linked inode once."""
    out = subprocess.run(["du", "-sk", "-c", *map(str, paths)], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def link_kind(path: Path) -> str:
    if path.is_symlink():
        return "symlink"
    return "hardlink" if path.stat().st_nlink > 1 else "copy"


class S3Server:
    """moto's S3 server on a free localhost port, with one bucket."""

    def __init__(self, log: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                        stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or self.process.poll() is not None:
                    raise SystemExit(f"moto server did not start; see {log}")
                time.sleep(0.2)
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1").create_bucket(Bucket=BUCKET)

    def close(self):
        self.process.terminate()
        self.process.wait(timeout=60)


def setup_repo(repo: Path, *, link_types: str, total_bytes: int, shard_mb: int, env: dict, endpoint: str, small_files: int) -> None:
    repo.mkdir(parents=True)
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "bench@example.com"], ["git", "config", "user.name", "bench"],
                ["dvc", "init", "-q"], ["dvc", "config", "core.analytics", "false"], ["dvc", "config", "cache.type", link_types],
                ["dvc", "config", "--local", "core.site_cache_dir", str(repo.parent / (repo.name + "-site-cache"))],
                ["dvc", "remote", "add", "-d", "team", f"s3://{BUCKET}/{repo.name}"],
                ["dvc", "remote", "modify", "--local", "team", "endpointurl", endpoint]):
        timed(cmd, repo, env)
    (repo / "params.yaml").write_text(f"synthetic:\n  total_bytes: {total_bytes}\n  shard_mb: {shard_mb}\n")
    (repo / "dvc.yaml").write_text(
        "stages:\n  capture:\n"
        f"    cmd: {sys.executable} {Path(__file__).resolve()} write --out data/hidden --bytes {total_bytes} "
        f"--shard-mb {shard_mb} --small-files {small_files} --timing data/write.json\n"
        "    params: [synthetic]\n"
        "    outs:\n      - data/hidden:\n          persist: true\n"
        "    metrics:\n      - data/write.json:\n          cache: false\n")
    timed(["git", "add", "-A"], repo, env)
    timed(["git", "commit", "-qm", "synthetic capture stage"], repo, env)


def measure(workdir: Path, name: str, *, link_types: str, total_bytes: int, shard_mb: int, env: dict, s3: S3Server,
            small_files: int = 0, drop_caches: bool = True) -> dict:
    """One row: every DVC operation on `total_bytes` of shards (or `small_files` files) in a fresh repo.
    `drop_caches` False keeps the page cache (a dry run on a shared machine: its reads then come from memory)."""
    repo, clone = workdir / name, workdir / (name + "-clone")
    setup_repo(repo, link_types=link_types, total_bytes=total_bytes, shard_mb=shard_mb, env=env, endpoint=s3.endpoint,
               small_files=small_files)
    row = {"name": name, "link_types": link_types, "shard_mb": shard_mb}
    timed(["dvc", "repro", "--no-commit"], repo, env)  # runs the writer, hashes, writes dvc.lock
    written = json.loads((repo / "data/write.json").read_text())
    row.update(bytes=written["bytes"], files=written["shards"], write_s=written["seconds"])
    row["commit_s"] = timed(["dvc", "commit", "-f"], repo, env)  # into the cache, linked back
    shard = repo / ("data/hidden/train/file-000000.bin" if small_files else "data/hidden/train/shard-00000.arrow")
    row["workspace_link"] = link_kind(shard)
    row["read_only"] = shard.resolve().stat().st_mode & 0o222 == 0
    timed(["git", "add", "-A"], repo, env)
    timed(["git", "commit", "-qm", "shards"], repo, env)

    shutil.rmtree(workdir / (name + "-site-cache"))
    row["page_cache_dropped"] = drop_caches and drop_page_cache()
    row["first_hash_s"] = timed(["dvc", "status"], repo, env)
    row["noop_status_s"] = min(timed(["dvc", "status"], repo, env) for _ in range(3))
    row["noop_repro_s"] = min(timed(["dvc", "repro"], repo, env) for _ in range(2))
    row["disk_mib"] = disk_kib(repo / "data/hidden", repo / ".dvc/cache") / 1024

    if drop_caches:
        drop_page_cache()
    row["push_s"] = timed(["dvc", "push"], repo, env)
    timed(["git", "clone", "-q", str(repo), str(clone)], workdir, env)
    for cmd in (["dvc", "config", "--local", "core.site_cache_dir", str(workdir / (name + "-clone-site-cache"))],
                ["dvc", "remote", "modify", "--local", "team", "endpointurl", s3.endpoint]):
        timed(cmd, clone, env)
    row["pull_s"] = timed(["dvc", "pull"], clone, env)
    from dflash_pipeline.data.shards import verify_split

    if not small_files:
        verify_split(clone / "data/hidden/train")  # every pulled shard's size and sha256 against the manifest
    row["pulled_verified"] = not small_files
    row["clone_status_clean"] = "up to date" in subprocess.run(["dvc", "status"], cwd=clone, env=env, capture_output=True,
                                                                text=True).stdout
    shutil.rmtree(clone)

    shutil.rmtree(repo / "data/hidden")
    if drop_caches:
        drop_page_cache()
    row["checkout_s"] = timed(["dvc", "checkout", "data/hidden"], repo, env)
    row["checkout_link"] = link_kind(shard)
    row["disk_after_checkout_mib"] = disk_kib(repo / "data/hidden", repo / ".dvc/cache") / 1024
    row["unprotect_s"] = timed(["dvc", "unprotect", "data/hidden"], repo, env)
    row["disk_after_unprotect_mib"] = disk_kib(repo / "data/hidden", repo / ".dvc/cache") / 1024
    shutil.rmtree(repo)
    shutil.rmtree(workdir / (name + "-site-cache"), ignore_errors=True)
    return row


PROJECTED = ("first_hash_s", "commit_s", "push_s", "pull_s", "checkout_s")


def project(base: dict, small: dict) -> list[dict]:
    """1 TiB and 10 TiB of 256 MiB shards from this run's two components: a cost per byte (the
    default row, less its files' share) and a cost per file (the small-files row). No-op status
    grows with the file count only. Transfer rates are this machine's loopback to moto: a real
    network and object store set their own ceiling."""
    # Every command pays DVC's start (imports, reading the repo) once: the no-op status measures it.
    def variable(row, key):
        return max(row[key] - row["noop_status_s"], 0.0)

    per_file = {key: variable(small, key) / small["files"] for key in PROJECTED}
    per_byte = {key: max(variable(base, key) - base["files"] * per_file[key], 0.0) / base["bytes"] for key in PROJECTED}
    status_per_file = max(small["noop_status_s"] - base["noop_status_s"], 0.0) / (small["files"] - base["files"])
    unprotect_per_byte = base["unprotect_s"] / base["bytes"]
    print("\nprojection at capture.shard_mb=256, committed link types (hours unless marked):")
    print(f"{'shards':>8}{'files':>9}{'first hash':>12}{'commit':>9}{'no-op status s':>16}{'push':>8}{'pull':>8}"
          f"{'checkout':>10}{'unprotect*':>12}{'disk GiB':>10}{'reflink-first GiB':>19}")
    result = []
    for tib in (1, 10):
        size = tib * 2**40
        files = size // (256 * 2**20)
        hours = {key: (size * per_byte[key] + files * per_file[key]) / 3600 for key in PROJECTED}
        row = {"tib": tib, "files": files, **{key.replace("_s", "_h"): value for key, value in hours.items()},
               "noop_status_s": base["noop_status_s"] + files * status_per_file,
               "unprotect_h": size * unprotect_per_byte / 3600, "disk_gib": size / 2**30, "disk_reflink_first_gib": 2 * size / 2**30}
        result.append(row)
        print(f"{str(tib) + ' TiB':>8}{files:>9}{row['first_hash_h']:>12.2f}{row['commit_h']:>9.2f}{row['noop_status_s']:>16.1f}"
              f"{row['push_h']:>8.2f}{row['pull_h']:>8.2f}{row['checkout_h']:>10.2f}{row['unprotect_h']:>12.2f}"
              f"{row['disk_gib']:>10.0f}{row['disk_reflink_first_gib']:>19.0f}")
    print("* what rerunning the stage of a persisted output costs first (capture's output is not persisted)")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    writer = sub.add_parser("write", help="the synthetic capture stage (run by DVC)")
    writer.add_argument("--out", type=Path, required=True)
    writer.add_argument("--bytes", type=int, required=True)
    writer.add_argument("--shard-mb", type=int, required=True)
    writer.add_argument("--timing", type=Path, required=True)
    writer.add_argument("--small-files", type=int, default=0, help="instead: this many 4 KiB files (per-file costs)")
    parser.add_argument("--gb", type=float, default=3.0, help="synthetic shard bytes per configuration")
    parser.add_argument("--shard-mb", default="64,256,1024", help="shard sizes, run with the committed link types")
    parser.add_argument("--link-types", default="reflink+hardlink+copy,symlink+copy,copy",
                        help="also run the default shard size with these cache.type values (+ for DVC's comma)")
    parser.add_argument("--small-files", type=int, default=10000, help="a last row of this many 4 KiB files: per-file costs")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dvc-costs"), help="on the filesystem to measure")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true",
                        help="the plumbing in seconds: one row of 2 MB at 256 MB shards, no small-files row, the page cache kept")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.gb, args.shard_mb, args.link_types, args.small_files = 2 / 1024, "256", "", 0
    if args.command == "write":
        if args.small_files:
            result = write_small_files(args.out, count=args.small_files)
        else:
            result = write_synthetic_split(args.out, total_bytes=args.bytes, shard_mb=args.shard_mb, seed=0)
        args.timing.write_text(json.dumps(result) + "\n")
        return

    total_bytes = int(args.gb * (1 << 30))
    env = {**os.environ, **CREDENTIALS, "DVC_NO_ANALYTICS": "1"}
    # The dvc of this interpreter's environment, whether or not that venv is activated.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    configs = [(f"hardlink-{mb}mb", COMMITTED_LINK_TYPES, int(mb)) for mb in args.shard_mb.split(",")]
    configs += [(f"{kinds.replace(',', '+')}-256mb", kinds.replace("+", ","), 256) for kinds in args.link_types.split(",") if kinds]
    if args.small_files:
        configs.append((f"hardlink-{args.small_files}x4kib", COMMITTED_LINK_TYPES, 0))
    rows = []
    for name, link_types, shard_mb in configs:
        print(f"{name}: writing, then dvc ...", flush=True)
        s3 = S3Server(args.workdir / f"moto-{name}.log")  # one server per row: moto keeps every pushed byte
        try:
            rows.append(measure(args.workdir, name, link_types=link_types, total_bytes=total_bytes, shard_mb=shard_mb, env=env, s3=s3,
                                small_files=args.small_files if shard_mb == 0 else 0, drop_caches=not args.dry_run))
        finally:
            s3.close()
        print("  " + json.dumps(rows[-1]), flush=True)

    base = next(r for r in rows if r["name"] == "hardlink-256mb")
    gib = base["bytes"] / (1 << 30)
    print(f"\n{gib:.2f} GiB of shards per row; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"page cache dropped before first hash, push and checkout: {base['page_cache_dropped']}")
    columns = ["files", "write_s", "commit_s", "first_hash_s", "noop_status_s", "noop_repro_s", "push_s", "pull_s",
               "checkout_s", "unprotect_s", "disk_mib", "disk_after_checkout_mib"]
    print(f"{'config':<28}{'after repro':>12}{'checkout':>10}{'read-only':>10}" + "".join(f"{c:>{max(14, len(c) + 2)}}" for c in columns))
    for row in rows:
        print(f"{row['name']:<28}{row['workspace_link']:>12}{row['checkout_link']:>10}{str(row['read_only']):>10}" + "".join(
            f"{row[c]:>{max(14, len(c) + 2)}.2f}" if isinstance(row[c], float) else f"{row[c]:>{max(14, len(c) + 2)}}" for c in columns))
    print("\nratios to hardlink-256mb (the committed default), same run:")
    for row in rows:
        if row is base or row["shard_mb"] == 0:
            continue
        ratios = "  ".join(f"{c} {row[c] / base[c]:.2f}x" for c in ("commit_s", "first_hash_s", "push_s", "pull_s",
                                                                       "checkout_s", "unprotect_s", "disk_mib") if base[c] > 0)
        print(f"  {row['name']}: {ratios}")
    print("\nrates at the default: first hash {:.0f} MiB/s, push {:.0f} MiB/s, pull {:.0f} MiB/s, "
          "unprotect {:.0f} MiB/s, no-op status {:.2f} s".format(
              base["bytes"] / 2**20 / base["first_hash_s"], base["bytes"] / 2**20 / base["push_s"],
              base["bytes"] / 2**20 / base["pull_s"], base["bytes"] / 2**20 / base["unprotect_s"], base["noop_status_s"]))
    small = next((r for r in rows if r["shard_mb"] == 0), None)
    projection = project(base, small) if small else []
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "gib_per_row": gib, "cpus": os.cpu_count(),
                                         "rows": rows, "projection": projection}, indent=2) + "\n")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
