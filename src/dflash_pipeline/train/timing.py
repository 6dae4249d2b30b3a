"""Train-step timing for the benches: steps run as the stage runs them (prefetcher, read-back
every READ_EVERY steps), from a synchronised start to a synchronised end."""

from dflash_pipeline.foundation.devices import READ_EVERY
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.train.prepare import StepPrefetcher
from dflash_pipeline.train.state import TrainingRun
from dflash_pipeline.train.step import read_back, train_step


def measure_train_steps(run: TrainingRun, *, steps: int, warmup: int = 3) -> dict:
    """Train steps timed as the stage runs them: each batch prepared by the stage's `StepPrefetcher`
    (a step ahead in its thread on a GPU, inline on a CPU), curve values read back every
    READ_EVERY steps and at the end, from a synchronised start to a synchronised end. So the step
    time includes whatever host preparation the device waits for. `warmup` steps run first
    (compilation, allocator, kernel choice) and are not counted; the run's plan and max_steps must
    cover warmup + steps. Returns step_ms, host_prepare_ms (mean host time to prepare one of the
    timed steps, in whichever thread did it; above step_ms the stage is host-bound),
    context_tokens_per_s and trained_positions_per_s."""
    from dflash_pipeline.foundation.devices import timed

    last = warmup + steps
    if steps < 1 or len(run.plan) < last or run.config.max_steps < last:
        raise PipelineError(f"measure_train_steps: {warmup} + {steps} steps need a plan and max_steps of at least {last}, "
                            f"the run has {len(run.plan)} and {run.config.max_steps}")
    prefetch = StepPrefetcher(run)

    def run_steps(first: int, end: int) -> list[dict]:
        rows, pending = [], []
        for step in range(first, end):
            pending.append(train_step(run, step, prefetch.get(step)))
            if len(pending) == READ_EVERY:
                rows += read_back(run, pending)
                pending = []
        return rows + read_back(run, pending)

    try:
        if warmup:
            run_steps(0, warmup)
        rows, seconds = timed(lambda: run_steps(warmup, last), run.device)
    finally:
        prefetch.close()
    host = [prefetch.prepare_seconds[step] for step in range(warmup, last)]
    return {"steps": steps, "step_ms": 1000 * seconds / steps, "host_prepare_ms": 1000 * sum(host) / len(host),
            "context_tokens_per_s": sum(row["context_tokens"] for row in rows) / seconds,
            "trained_positions_per_s": sum(row["trained_positions"] for row in rows) / seconds,
            "prefetch_thread": prefetch.pool is not None}
