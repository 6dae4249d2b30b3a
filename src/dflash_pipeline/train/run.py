"""Stage `train`: a DFlash drafter trained on the captured shards. This module sets a run up and
runs its loop; the rest of the wing holds the parts:

    run_train = setup_run (shards `contract`, drafter, head, optimizer, `schedule`; `resume` or start fresh)
              + a loop of train_step (`prepare` on the host, `step` on the device), validation_tau
                (`validation`) every eval_every steps and a checkpoint (`resume`) every save_every steps,
                returning the run's `record`

`state` holds the TrainingRun every part reads, `distributed` the torchrun ranks, `features` the
train split on the device, `timing` the benches' step measurement.

Inputs: the train/val shard folders (`shards`), the target (only its embedding and LM head are
read, from its weight files) and `TrainConfig`. Outputs in the checkpoints folder: `step_NNNNNN/`
checkpoints and the resume state (`checkpoints` describes both); the stage script writes the
metrics and curves (`report`).

One step: a packed batch of sequences (about `tokens_per_step` context tokens), up to
`anchors_per_sequence` anchors per sequence drawn afresh (`blocks`), every block drafted in one
forward under the DFlash mask, decayed cross-entropy on slots 1..B-1 through a chunked LM head
that never holds more than `logits_chunk` x vocab logits, plus the architecture's own term
(`Architecture.extra_loss`, e.g. DFlash2's selector). What a step sees depends only on
(seed, step), so a resumed run, or a torchrun run of any size, replays exactly the same batches.
"""
import time
from pathlib import Path

import torch

from dflash_pipeline.drafters.build import choose_architecture, choose_mask_token, drafter_config_for, new_drafter
from dflash_pipeline.drafters.checkpoints import list_checkpoints
from dflash_pipeline.foundation.config import TrainConfig
from dflash_pipeline.foundation.devices import READ_EVERY
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.load import TargetInfo, load_target_head
from dflash_pipeline.train.contract import check_contract, open_shards, shards_record, used_token_ids
from dflash_pipeline.foundation.distributed import init_distributed
from dflash_pipeline.train.features import ResidentFeatures, channel_rms_scale
from dflash_pipeline.train.loss import TrainingVocabulary, default_gamma
from dflash_pipeline.train.prepare import StepPrefetcher, static_shape
from dflash_pipeline.train.record import TrainRecord, held_out_tau, window_loss
from dflash_pipeline.train.resume import resume_or_start_fresh, save_checkpoint
from dflash_pipeline.train.schedule import plan_steps
from dflash_pipeline.train.state import LOSS_WINDOW, TrainingRun
from dflash_pipeline.train.step import NonFiniteLoss, StepResult, loss_function, read_back, train_step
from dflash_pipeline.train.validation import validation_tau


def setup_run(config: TrainConfig, *, target: TargetInfo, train_dir: Path, val_dir: Path, out_dir: Path, device: str,
              log=print, source: str = "params.yaml") -> TrainingRun:
    """Shards, drafter, frozen head, optimizer and step plan; resumed from `out_dir` when it holds
    a checkpoint of this exact run configuration, else `out_dir` is cleared of other runs' ones.
    `source`: the params file `config` came from, named in configuration errors."""
    architecture = choose_architecture(config, source=source)  # a bad architecture or option stops before any work
    device, world, rank = init_distributed(device)
    on_gpu = device.startswith("cuda")
    torch.manual_seed(config.seed)
    if not on_gpu:
        torch.use_deterministic_algorithms(True, warn_only=True)
    train_set, val_set = open_shards(target, train_dir, val_dir)
    manifest = train_set.manifest

    if config.mask_token_id is not None:
        mask_token_id, mask_reason = config.mask_token_id, "set in params (train.mask_token_id)"
        if not 0 <= mask_token_id < target.vocab_size:
            raise PipelineError(f"{source}: key 'train.mask_token_id' must be in the vocabulary of the target (0..{target.vocab_size - 1}), "
                                f"got {mask_token_id}")
    else:
        mask_token_id, mask_reason = choose_mask_token(target, used_token_ids(train_set, val_set))
    gamma = config.gamma if config.gamma is not None else default_gamma(config.block_size)
    drafter_config = drafter_config_for(target, config, layer_ids=manifest.layer_ids, mask_token_id=mask_token_id,
                                        extra={"mask_token": mask_reason, "gamma": gamma}, source=source)
    check_contract(manifest, target=target, drafter_config=drafter_config, source=str(train_dir / "manifest.json"))
    if config.distill_weight > 0 and manifest.target_top_k == 0:
        raise PipelineError(f"{train_dir / 'manifest.json'}: train.distill_weight {config.distill_weight} needs the target's top-k, "
                            "and these shards hold none; set capture.target_top_k > 0 and rerun capture")
    drafter, init_note = new_drafter(config, target, drafter_config)
    if config.feature_norm == "channel_rms":
        drafter.feature_scale.copy_(channel_rms_scale(train_set))
    drafter.to(device).train()
    head = load_target_head(target, device=device)
    if config.train_vocab == "data":
        answer_tokens = torch.cat([train_set[i].input_ids[train_set[i].loss_mask.bool()].long() for i in range(len(train_set))])
        vocabulary = TrainingVocabulary.from_tokens(head, answer_tokens)
        drafter.set_draft_vocab(vocabulary.token_ids)  # it drafts over what it learnt to rank
    else:
        vocabulary = TrainingVocabulary.full(head)
    run = TrainingRun(
        config=config, drafter=drafter, head=head, vocabulary=vocabulary,
        # Fused: one kernel for every parameter, and no per-step read of the step counters.
        optimizer=torch.optim.AdamW(drafter.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95), fused=True),
        train_set=train_set, val_set=val_set,
        plan=plan_steps(train_set.lengths(), tokens_per_step=config.tokens_per_step, max_steps=config.max_steps, seed=config.seed),
        mask_token_id=mask_token_id, gamma=gamma, device=device, world=world, rank=rank,
        attention=config.attention if config.attention != "auto" else ("flex" if on_gpu else "sdpa"),
        loss_options=architecture.loss_options,
        record={"train_config": architecture.record(config), "target_fingerprint": target.fingerprint,
                "shards": shards_record(train_set, val_set, train_dir=train_dir, val_dir=val_dir)},
    )
    run.lengths = train_set.lengths()
    if on_gpu:
        run.resident = ResidentFeatures.upload(train_set, run.lengths, device)
    if config.compile:
        run.static_shape = static_shape(run)
    run.loss_fn = loss_function(run)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    resume_or_start_fresh(run, Path(out_dir), log=log)
    if rank == 0:
        log(f"train: drafter {config.num_layers} layer(s), {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params "
            f"(init {init_note}); block {config.block_size}, gamma {gamma}; softmax over {vocabulary.head_rows.shape[0]} tokens; "
            f"mask token {mask_token_id} ({mask_reason}); {len(train_set)} train sequences / {manifest.tokens:,} tokens; "
            f"{config.max_steps} steps on {device} x{world}, {run.attention} attention"
            + (f"; train features resident on the device ({run.resident.table.numel() * 2 / 2**30:.2f} GB)" if run.resident else ""))
    return run


def run_train(config: TrainConfig, *, target: TargetInfo, train_dir: Path, val_dir: Path, out_dir: Path, device: str,
              log=print, source: str = "params.yaml") -> TrainRecord:
    """Train (or resume) a drafter; return its record (final figures and curve). Rank 0 writes every file.

    A run that finds itself already finished (resumed at its last step) reports the metrics of
    its saved state, not an empty loop's.
    """
    import torch.distributed as dist

    from dflash_pipeline.foundation.progress import progress

    run = setup_run(config, target=target, train_dir=train_dir, val_dir=val_dir, out_dir=out_dir, device=device, log=log, source=source)
    rank, world = run.rank, run.world
    bar = progress(total=config.max_steps, initial=run.start_step, desc="train", unit="step", disable=rank != 0)
    started, seconds_before = time.perf_counter(), run.seconds
    pending: list[StepResult] = []
    prefetch = StepPrefetcher(run)

    def read_pending() -> dict | None:
        """Turn the steps still on the device into curve rows; the last one, or None."""
        try:
            rows = read_back(run, pending)
        except NonFiniteLoss as exc:
            kept = list_checkpoints(out_dir)
            raise PipelineError(f"{exc}; stopped, last good checkpoint {kept[-1].name if kept else '(none)'} kept") from None
        pending.clear()
        run.seconds = seconds_before + time.perf_counter() - started
        for row in rows:
            row["seconds"] = round(run.seconds, 2)  # when the step's values were read (every READ_EVERY steps)
            run.tokens_seen += row.pop("context_tokens")
            row.pop("trained_positions")
            run.recent_losses = (run.recent_losses + [row.pop("loss_value")])[-LOSS_WINDOW:]
            if rank == 0:
                run.curve.append(row)
        return rows[-1] if rows else None

    try:
        for step in range(run.start_step, config.max_steps):
            pending.append(train_step(run, step, prefetch.get(step)))
            validate = rank == 0 and ((step + 1) % config.eval_every == 0 or step + 1 == config.max_steps)
            save = (step + 1) % config.save_every == 0 or step + 1 == config.max_steps
            row = None
            if validate or save or (step + 1) % READ_EVERY == 0:
                row = read_pending()
            if validate:
                result = validation_tau(run)
                row.update(tau=round(result["tau"], 4), tau_ci95=round(result["tau_ci95"], 4),
                           slot_accuracy=[round(a, 4) for a in result["slot_accuracy"]])
            if row is not None:
                bar.set_postfix_str(f"loss {sum(run.recent_losses) / len(run.recent_losses):.3f} "
                                    f"{run.tokens_seen / max(run.seconds, 1e-9):.0f} tok/s"
                                    + (f" tau {row['tau']:.3f}" if "tau" in row else ""), refresh=False)
            bar.update(1)
            if save:
                if rank == 0:
                    save_checkpoint(run, out_dir, step + 1)
                if world > 1:
                    dist.barrier()
    finally:
        prefetch.close()
        bar.close()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return final_record(run)


def final_record(run: TrainingRun) -> TrainRecord:
    """The run's record as it stands: after the loop, or at once for a run resumed at its last step."""
    return TrainRecord(
        steps=run.config.max_steps,
        resumed_from=run.start_step,
        last_checkpoint=run.last_saved,
        loss=window_loss(run.recent_losses),
        held_out=held_out_tau(run.curve),
        tokens_per_s=round(run.tokens_seen / run.seconds, 1) if run.seconds > 0 and run.tokens_seen else None,
        seconds=round(run.seconds, 3),  # ms: a tiny run takes well under 0.1 s
        mask_token_id=run.mask_token_id,
        curve=run.curve,
    )
