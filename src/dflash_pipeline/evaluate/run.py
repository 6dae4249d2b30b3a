"""Stage `evaluate`: score every checkpoint and any baseline drafter, fast and honestly.

Two measurements (definitions in `scoring` and `end_to_end`, and in the README):

1. Teacher-forced, on the cached val features, no target forward (`scoring.score_teacher_forced`):
   τ, per-slot acceptance and DDTree streaks of thousands of blocks in seconds, with 95%
   intervals over prompts, split by prompt category, and each drafter's paired difference to the
   chosen one.
2. End-to-end speculative decoding with the real target (`end_to_end.end_to_end`): greedy chains and
   greedy DDTrees (their output must equal plain greedy decoding token for token) and sampled
   chains at each T > 0; τ per step, tokens/s of both measured alternately in one process, the
   time split and the break-even τ of this machine.

The best checkpoint is the one with the highest teacher-forced τ (not the lowest loss). Of each
decoded drafter's lossless greedy modes (the chain at its verify length, each tree budget) the
fastest measured is its best mode (`best_mode.choose_decoding_mode`): what the headline speedup
reports and what `dflash-pipeline decode` decodes with. This module picks and checks the
candidates and runs the two measurements into the typed record (`record.Evaluation`);
`evaluate.report` writes the files, and `evaluate.compare` pairs two runs' outputs.
"""

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from dflash_pipeline.drafters.checkpoints import list_checkpoints
from dflash_pipeline.foundation.devices import autocast, machine_description
from dflash_pipeline.measure.verify_plan import VerifyPlan, measure_forward_costs, plan_verify_tokens
from dflash_pipeline.measure.end_to_end import EndToEndPrompt, RunKey, end_to_end, summarize_end_to_end
from dflash_pipeline.decoding.session import open_session
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import check_recorded_digest
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.speculation.sampling import Sampling
from dflash_pipeline.speculation.modes import DecodingMode
from dflash_pipeline.measure.record import CandidateRecord, Decoding, Evaluation, Paired
from dflash_pipeline.measure.scoring import BlockScores, comparison_verdict, paired_difference, score_teacher_forced, summarize_blocks
from dflash_pipeline.data.shards import open_split
from dflash_pipeline.foundation.stats import format_interval
from dflash_pipeline.target.load import load_target_head
from dflash_pipeline.target.placement import TargetPlacement, whole_target_problem
from dflash_pipeline.drafters.loading import load_checked_checkpoint, load_checked_export
from dflash_pipeline.evaluate.best_mode import choose_decoding_mode, describe_best_mode

# ----------------------------------------------------------------------------- drafters


@dataclass
class Candidate:
    """One drafter under evaluation: a checkpoint of this run or an external baseline."""

    name: str  # "step_000900" or the baseline folder's name
    kind: str  # "checkpoint" | "baseline"
    path: Path
    drafter: DFlashDrafter
    step: int | None = None


def select_checkpoints(folders: list[Path], which, *, source: str = "params.yaml") -> list[Path]:
    """`which`: "final", "all" or a list of steps (each must exist; `source` names the params file that asks)."""
    if not folders:
        raise PipelineError("evaluate: no checkpoints found; run the `train` stage first (dvc repro train)")
    if which == "final":
        return folders[-1:]
    if which == "all":
        return folders
    by_step = {int(folder.name.split("_")[1]): folder for folder in folders}
    missing = [step for step in which if step not in by_step]
    if missing:
        raise PipelineError(f"{source}: key 'evaluate.checkpoints' asks for step {missing[0]}, which has no checkpoint "
                            f"(have {sorted(by_step)}), got {which!r}")
    return [by_step[step] for step in which]


# ----------------------------------------------------------------------------- the stage


def sequence_categories(dataset, generated_val: Path | None) -> list[str]:
    """The prompt category of each val sequence (from the generate stage's table), else "all"."""
    by_id = {}
    if generated_val is not None and Path(generated_val).is_file():
        import pyarrow.parquet as pq

        table = pq.read_table(generated_val, columns=["prompt_id", "category"])
        by_id = dict(zip(table.column("prompt_id").to_pylist(), table.column("category").to_pylist()))
    return [by_id.get(dataset[index].sequence_id) or "all" for index in range(len(dataset))]


def load_candidates(*, checkpoint_folders: list[Path], baseline_dirs: list[Path], target, layer_ids: list[int], device: str) -> list[Candidate]:
    """Every drafter to score, each checked against the target and the shards first.

    A checkpoint, and a baseline exported by this pipeline (its dflash_pipeline.json names the
    target it was trained for), must belong to this very target; a published drafter carries no
    fingerprint, and only its shapes and taps can be checked.
    """
    candidates = []
    for folder in checkpoint_folders:
        loaded = load_checked_checkpoint(folder, target=target, layer_ids=layer_ids, device=device)
        name = folder.name if folder.name not in {c.name for c in candidates} else str(folder)  # two runs' step_000900
        candidates.append(Candidate(name=name, kind="checkpoint", path=folder, drafter=loaded.drafter, step=loaded.step))
    names = {c.name for c in candidates}
    for directory in baseline_dirs:
        directory = Path(directory)
        loaded = load_checked_export(directory, target=target, layer_ids=layer_ids, device=device)
        name = directory.name if directory.name not in names else str(directory)
        names.add(name)
        candidates.append(Candidate(name=name, kind="baseline", path=directory, drafter=loaded.drafter))
    return candidates


def choose_best(candidates: list[CandidateRecord]) -> CandidateRecord:
    """The checkpoint with the highest teacher-forced tau (the later step on a tie)."""
    checkpoints = [candidate for candidate in candidates if candidate.kind == "checkpoint"]
    return max(checkpoints, key=lambda candidate: (candidate.teacher_forced.tau.mean, candidate.step))


def val_prompts(generated_val: Path, count: int) -> list[tuple[str, list[int]]]:
    """`count` val prompts of the generate stage's table as (prompt id, token ids), taken round
    robin over the categories (file order within each), so a few prompts still cover the mix."""
    import pyarrow.parquet as pq

    table = pq.read_table(generated_val, columns=["prompt_id", "category", "prompt_ids"]).to_pylist()
    by_category: dict[str, list] = {}
    for row in table:
        by_category.setdefault(row["category"] or "", []).append((row["prompt_id"], row["prompt_ids"]))
    queues = list(by_category.values())
    chosen = []
    while len(chosen) < count and any(queues):
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    return chosen


def check_decoding_context(prompts: list[tuple[str, list[int]]], *, max_new_tokens: int, context: int | None, generated_val: Path,
                           source: str) -> None:
    """Refuse, in one line naming `source` and the key, to decode a val prompt whose answer of
    `max_new_tokens` would run past the target's context (`context`: None checks nothing)."""
    for prompt_id, ids in prompts if context else []:
        if len(ids) + max_new_tokens > context:
            raise PipelineError(f"{source}: key 'evaluate.max_new_tokens' ({max_new_tokens}) plus val prompt {prompt_id} of "
                                f"{generated_val} ({len(ids)} tokens) must fit the target's context, {context} tokens (its "
                                f"max_position_embeddings, in target.json), got {max_new_tokens}")


@dataclass
class EvaluationResult:
    """Everything the evaluate stage measured: the typed record, and the raw material of the
    per-block and per-prompt files (`evaluate.report` turns both into files)."""

    record: Evaluation
    blocks: dict[str, BlockScores]  # drafter name -> per-block scores
    categories: list[str]  # category of each val sequence
    prompt_ids: list[str] = field(default_factory=list)  # prompt id of each val sequence (pairs blocks across runs)
    e2e_results: list[EndToEndPrompt] = field(default_factory=list)
    layer_ids: list[int] = field(default_factory=list)


def score_candidates(candidates: list[Candidate], head, val_set, categories: list[str], config, *, device: str, log=print
                     ) -> tuple[list[CandidateRecord], dict[str, BlockScores]]:
    """The teacher-forced record and block scores of every candidate."""
    records, blocks = [], {}
    for candidate in candidates:
        began = time.perf_counter()
        with autocast(device):
            scores = score_teacher_forced(candidate.drafter, head, val_set, anchors_per_sequence=config.anchors_per_sequence,
                                          tokens_per_batch=config.tokens_per_batch, tree_budgets=list(config.tree_budgets),
                                          seed=config.seed, progress=True)
        scored = replace(summarize_blocks(scores, categories), seconds=round(time.perf_counter() - began, 2))
        records.append(CandidateRecord(name=candidate.name, kind=candidate.kind, path=str(candidate.path), step=candidate.step,
                                       block_size=candidate.drafter.config.block_size, num_layers=candidate.drafter.config.num_layers,
                                       teacher_forced=scored))
        blocks[candidate.name] = scores
        log(f"evaluate: {candidate.name}: tau {format_interval(scored.tau.mean, scored.tau.ci95)} over {scored.blocks} blocks "
            f"of {scored.prompts} prompts ({scored.seconds:.1f} s)")
    return records, blocks


def choose_and_pair(records: list[CandidateRecord], blocks: dict[str, BlockScores], *, teacher_forced_seconds: float) -> Evaluation:
    """The evaluation of scored candidates: the chosen checkpoint (`choose_best`; the first
    candidate when only baselines were scored) and each candidate's τ difference to it, paired
    over prompts (`scoring.paired_difference`)."""
    chosen = choose_best(records).name if any(r.kind == "checkpoint" for r in records) else records[0].name
    paired = []
    for record in records:
        mean, half, prompts = paired_difference(blocks[record.name], blocks[chosen])
        paired.append(replace(record, vs_chosen=Paired(round(mean, 4), round(half, 4), prompts)))
    return Evaluation(candidates=paired, chosen=chosen, teacher_forced_seconds=teacher_forced_seconds)


def summarize_decoding(name: str, greedy: list[EndToEndPrompt], sampled: dict[float, list[EndToEndPrompt]], *, tree_budgets: list[int],
                       chain_mode: DecodingMode, plan: VerifyPlan | None = None, machine: str = "", engine: str = "") -> Decoding:
    """One drafter's end-to-end record from the runs of `decode_end_to_end`, each found by its
    candidate and mode (`RunKey`): its greedy chain (in `chain_mode`, whose verify length `plan`
    chose when it did), its greedy trees, its sampled chains (in `sampled[temperature]`; samples
    part from plain sampling by design, so they carry no lossless check) and the best greedy mode
    (`choose_decoding_mode`, measured on `machine` with `engine`)."""
    chain_key = RunKey(name, chain_mode)
    chain = replace(summarize_end_to_end(greedy, chain_key), verify_tokens=chain_mode.verify_tokens)
    if plan is not None:
        figures = plan.as_dict()
        chain = replace(chain, forward_cost_steps=figures["forward_cost_steps"],
                        expected_tokens_per_step_cost=figures["expected_tokens_per_step_cost"])
    trees = {budget: summarize_end_to_end(greedy, RunKey(name, DecodingMode.tree(budget))) for budget in tree_budgets}
    return Decoding(chain=chain, trees=trees,
                    sampled={temperature: replace(summarize_end_to_end(runs, chain_key), lossless_rate=None, mismatches=[])
                             for temperature, runs in sorted(sampled.items())},
                    best=choose_decoding_mode(chain, trees, machine=machine, engine=engine), engine=engine)


def decode_end_to_end(names: list[str], candidates: list[Candidate], head, *, target, layer_ids: list[int], feature_dtype: str,
                      generated_val: Path, config, device: str, acceptance: dict[str, list[float]] | None = None,
                      placement: TargetPlacement | None = None) -> tuple[dict[str, Decoding], list[EndToEndPrompt]]:
    """Speculative decoding with each named drafter against plain decoding, on the real target:
    greedy chains, greedy DDTrees at every `config.tree_budgets` (lossless both), and sampled
    chains at every T > 0 of `config.temperatures` under `config.sampling_rule`.

    A chain verifies `config.verify_tokens` drafted tokens, or else, with `acceptance` (name -> the
    drafter's teacher-forced conditional acceptance per slot), the number that pays best on this
    machine (`verify_plan.plan_verify_tokens`); else all B-1.
    """
    by_name = {c.name: c for c in candidates}
    session = open_session(target, by_name[names[0]].drafter, device=device, layer_ids=layer_ids, head=head, placement=placement)
    sessions = {name: session.with_drafter(by_name[name].drafter) for name in names}  # one target, each drafter
    model, eos_ids = session.model, session.eos_ids
    prompts = val_prompts(generated_val, config.num_prompts)
    verify_tokens, plans = {}, {}
    if config.verify_tokens is None and acceptance and prompts:
        costs = measure_forward_costs(model, prompts[0][1], max(by_name[name].drafter.config.block_size for name in names))
        for name in names:
            plans[name] = plan_verify_tokens(model, sessions[name].speculation(), prompts[0][1], acceptance[name],
                                             eos_ids=eos_ids, feature_dtype=feature_dtype, costs=costs)
            verify_tokens[name] = plans[name].tokens
    for name in names:
        block = by_name[name].drafter.config.block_size
        verify_tokens.setdefault(name, min(config.verify_tokens or block - 1, block - 1))

    chains = [(name, sessions[name].speculation(DecodingMode.chain(verify_tokens[name]))) for name in names]
    chain_modes = {name: speculation.mode for name, speculation in chains}
    trees = [(name, sessions[name].speculation(DecodingMode.tree(budget))) for name in names for budget in config.tree_budgets]
    common = dict(max_new_tokens=config.max_new_tokens, eos_ids=eos_ids, feature_dtype=feature_dtype, progress=True)
    results = end_to_end(model, chains + trees, prompts, **common)
    sampled = {}
    for temperature in [t for t in config.temperatures if t > 0]:
        sampling = Sampling(temperature, rule=config.sampling_rule, seed=config.seed)
        sampled[temperature] = end_to_end(model, chains, prompts, sampling=sampling, **common)
    machine = f"{device} on {machine_description()}"  # which mode pays depends on it
    engine = session.engine
    return {name: summarize_decoding(name, results, sampled, tree_budgets=list(config.tree_budgets), chain_mode=chain_modes[name],
                                     plan=plans.get(name), machine=machine, engine=engine) for name in names}, results


def run_evaluate(config, *, target, hidden_val_dir: Path, generated_val: Path | None, checkpoints_dir: Path | None = None,
                 checkpoint_folders: list[Path] | None = None, baseline_dirs: list[Path] | None = None, device: str = "cpu",
                 log=print, source: str = "params.yaml", placement: TargetPlacement | None = None) -> EvaluationResult:
    """Score checkpoints and baselines.

    Teacher-forced scoring reads the cached hidden states and, of the target, only its embedding
    and LM head (`load_target_head`), so it runs on a machine far smaller than the target. End-to-end
    decoding loads the target: whole on `device` when it fits there, split over devices when
    `placement` says so, else it is skipped and the record says why (`Evaluation.decoding_skipped`).

    Checkpoints: `checkpoint_folders` when given (any folders with checkpoint.json), else those of
    `checkpoints_dir` chosen by `config.checkpoints`. Baselines: `baseline_dirs`, else `config.baselines`.
    """
    config.validate_context(target.max_position_embeddings, source)
    if generated_val is not None and Path(generated_val).is_file():
        check_recorded_digest(generated_val)  # its categories and prompts are read below; generate recorded its sha256
    if config.num_prompts > 0 and generated_val is not None:  # before any scoring: decoding comes last
        check_decoding_context(val_prompts(generated_val, config.num_prompts), max_new_tokens=config.max_new_tokens,
                               context=target.max_position_embeddings, generated_val=generated_val, source=source)
    val_set = open_split(hidden_val_dir, expected_fingerprint=target.fingerprint)
    manifest = val_set.manifest
    if checkpoint_folders is not None:
        folders = [Path(folder) for folder in checkpoint_folders]
    else:
        folders = (select_checkpoints(list_checkpoints(checkpoints_dir), config.checkpoints, source=source)
                   if checkpoints_dir is not None else [])
    baselines = [Path(b) for b in (baseline_dirs if baseline_dirs is not None else config.baselines)]
    candidates = load_candidates(checkpoint_folders=folders, baseline_dirs=baselines, target=target, layer_ids=manifest.layer_ids,
                                 device=device)
    if not candidates:
        raise PipelineError("evaluate: nothing to evaluate (no checkpoint selected and no baseline)")
    head = load_target_head(target, device=device)
    categories = sequence_categories(val_set, generated_val)

    started = time.perf_counter()
    records, blocks = score_candidates(candidates, head, val_set, categories, config, device=device, log=log)
    evaluation = choose_and_pair(records, blocks, teacher_forced_seconds=round(time.perf_counter() - started, 2))
    for baseline in evaluation.baselines:
        paired = baseline.vs_chosen
        log(f"evaluate: {comparison_verdict(baseline.name, evaluation.chosen, paired.mean, paired.ci95, paired.prompts)}")
    result = EvaluationResult(record=evaluation, blocks=blocks, categories=categories, layer_ids=manifest.layer_ids,
                              prompt_ids=[val_set[index].sequence_id for index in range(len(val_set))])
    skipped = None
    if config.num_prompts > 0 and generated_val is not None and not (placement is not None and placement.split):
        skipped = whole_target_problem(target.path, device, head.embed_weight.dtype)
    if skipped is not None:
        log(f"evaluate: end-to-end decoding skipped: {skipped}")
        result.record = replace(evaluation, decoding_skipped=skipped)
    elif config.num_prompts > 0 and generated_val is not None:
        names = [evaluation.chosen] + [b.name for b in evaluation.baselines if b.name != evaluation.chosen]
        acceptance = {c.name: c.teacher_forced.slot_acceptance_conditional for c in evaluation.candidates}
        decodings, result.e2e_results = decode_end_to_end(names, candidates, head, target=target, layer_ids=manifest.layer_ids,
                                                          feature_dtype=manifest.feature_dtype, generated_val=generated_val,
                                                          config=config, device=device, acceptance=acceptance,
                                                          placement=placement)
        result.record = replace(evaluation, candidates=[replace(c, decoding=decodings.get(c.name, c.decoding)) for c in evaluation.candidates])
        for name, decoding in decodings.items():
            log(f"evaluate: {name}: {describe_best_mode(decoding.best)}")
            modes = [("", decoding.chain)] + [(f" (tree {budget})", tree) for budget, tree in decoding.trees.items()]
            for mode, run in modes:
                for mismatch in run.mismatches:
                    verdict = "differs at a near-tie (rounding, see end_to_end.is_near_tie)" if mismatch.near_tie else "NOT LOSSLESS"
                    log(f"evaluate: {verdict}: {name}{mode} differs from plain greedy decoding on prompt {mismatch.prompt_id} "
                        f"at answer token {mismatch.position}")
    return result
