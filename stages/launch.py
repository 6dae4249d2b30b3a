"""Run a stage script as `launch.processes` processes on this node: dvc.yaml's generate, capture
and train commands go through it, so `dvc exp run -S launch.processes=8` runs them on 8 GPUs.

    python stages/launch.py --processes 1 stages/generate.py --params params.yaml ...
        -> the script itself, in this process (exec: same exit status, signals and one-line errors)
    python stages/launch.py --processes 8 stages/generate.py --params params.yaml ...
        -> torchrun --standalone --nproc_per_node 8 stages/generate.py --params params.yaml ...

Nothing is scheduled here: one process is the script, several are torchrun's (one node, its own
rendezvous). Several nodes run the stage by hand, every node the same torchrun line with
`--nnodes`, then `dvc commit` records it (docs/scale.md).
"""

import os
import sys

USAGE = "usage: python stages/launch.py --processes N STAGE_SCRIPT [ARGS...]"


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def command(processes: int, script: str, args: list[str]) -> list[str]:
    """The command line that runs `script` as `processes` processes."""
    if processes == 1:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), script, *args]


def check_processes(value: str) -> int:
    """launch.processes as a whole number >= 1 that this node can run (one GPU each, where there are GPUs)."""
    try:
        processes = int(value)
    except ValueError:
        fail(f"params.yaml: key 'launch.processes' must be a whole number >= 1, got {value!r}")
    if processes < 1:
        fail(f"params.yaml: key 'launch.processes' must be >= 1, got {processes}")
    if processes > 1:
        import torch  # only to count GPUs: a one-process stage starts without paying for the import twice

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus and processes > gpus:
            fail(f"params.yaml: key 'launch.processes' is {processes}, and this node has {gpus} GPU(s); "
                 "use at most one process per GPU")
    return processes


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] != "--processes":
        fail(USAGE)
    processes = check_processes(argv[1])
    script, args = argv[2], argv[3:]
    if not os.path.isfile(script):
        fail(f"{script}: no such stage script ({USAGE})")
    line = command(processes, script, args)
    sys.stdout.flush()
    os.execv(line[0], line)


if __name__ == "__main__":
    main(sys.argv[1:])
