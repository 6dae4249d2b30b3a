"""Stage `generate`: the target answers every prompt greedily, in its own chat template.

A drafter must learn the target's distribution, so its training answers are the target's own
greedy outputs, never a dataset's reference answers. Inputs: a `PromptSet`, the target (from
target.json) and `GenerateConfig`. Output folder (a persistent DVC output):

    chunks/settings.json       what the cached answers were generated with
    chunks/chunk-NNNNN.parquet answers, written atomically batch by batch (the resume cache)
    train.parquet, val.parquet the selected prompts' rows, in prompt-file order
    *.parquet.sha256           each Parquet file's sha256 (`sha256sum -c` format), written before
                               the file is renamed into place: a resume keeps a chunk only when
                               its bytes match it, and capture, evaluate and `dflash-pipeline
                               verify` check train/val against theirs
    summary.json               counts, token totals, finish reasons, skipped rows, settings
                               (what the answers are; this run's timings are returned in the
                               summary's `this_run`, which the stage writes as a metrics file
                               outside the folder, so a rerun that adds nothing changes nothing)

Rows hold the prompt id, category, messages, the exact prompt token ids (chat template applied)
and the answer token ids (ending with the EOS token when the answer stopped), so later stages
never re-tokenise. A killed run resumes from its chunks; chunks generated with other settings
(another target, template option or length cap) are discarded, never mixed in, and a chunk that
does not match its sha256 record (a flipped bit, or no record) is answered again, never reused
because it merely parses.

Under torchrun (`launch.processes`, `stages/launch.py`) every rank makes the same batch plan and
answers its own batches into the one chunk folder (a folder all nodes share, on several nodes);
rank 0 assembles the splits, the same bytes as one process writes. The answer cache and the settings
it is keyed by are `generate.cache`.
"""

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.foundation.config import GenerateConfig, as_dict
from dflash_pipeline.foundation.distributed import Ranks, barrier, init_distributed, leave_process_group, sum_over_ranks
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.foundation.files import write_json_atomic
from dflash_pipeline.data.prompts import Prompt, PromptSet
from dflash_pipeline.target.load import TargetInfo
from dflash_pipeline.target.placement import TargetPlacement
from dflash_pipeline.generate.cache import AnswerCache, generation_settings, rows_table, write_parquet_atomic


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]
    finish_reason: str


def render_prompt(tokenizer, prompt: Prompt, *, system_prompt: str | None, enable_thinking: bool) -> list[int]:
    """Token ids of the conversation in the target's chat template, ready for the answer."""
    messages = prompt.as_messages()
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    # The template already wrote every special token it wants; adding BOS again would shift ids.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decoding_engine(model) -> str:
    """The kernel path `greedy_generate` takes for this model, recorded in the generate settings
    so answers of one path are never mixed with another's (they can part at bf16 near-ties): the
    static KV step on every device (`decoding.static_decoder`), replayed as a CUDA graph on a GPU
    (where transformers' own loop spent ~50 ms of host work per step) and attending over the
    written columns only on a CPU (where it measured 1.09x transformers' loop, identical answers:
    6dfc1ff:bench/generate.py, run with --engines). A target it cannot serve is refused in one line
    (`static_decoder.check_servable`), never sent down another path."""
    from dflash_pipeline.decoding.plain import engine_name

    return engine_name(model)


def greedy_generate(model, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: set[int], pad_id: int, on_step=None) -> list[Answer]:
    """Greedy-decode a batch of prompts with left padding on the static KV step (`decoding_engine`).
    `on_step(new_tokens, finished_rows)` reports progress."""
    decoding_engine(model)
    return static_greedy_generate(model, prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id, on_step=on_step)


def left_padded(prompts: list[list[int]], pad_id: int):
    """Prompts right-aligned in one [B, W] id tensor, and the [B, W] mask of their real tokens."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        valid[row, width - len(ids):] = True
    return input_ids, valid


def static_greedy_generate(model, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: set[int], pad_id: int,
                           on_step=None, read_every: int | None = None) -> list[Answer]:
    """The prompts left-padded into one batch and answered together by the engine's plain step
    (`decoding.plain.decode_batch`: the step evaluate's plain baseline takes at one row), the host
    reading which rows ended every `read_every` steps (16 on a GPU, every step on a CPU)."""
    from dflash_pipeline.decoding.plain import decode_batch

    input_ids, valid = left_padded(prompts, pad_id)
    reported = [0, 0]  # answer tokens (a row's EOS included) and rows ended, as last reported

    def on_read(tokens: int, rows_ended: int) -> None:
        if on_step is not None:
            on_step(tokens - reported[0], rows_ended - reported[1])
        reported[:] = tokens, rows_ended

    answers = decode_batch(model, input_ids, valid, max_new_tokens=max_new_tokens, eos_ids=eos_ids, on_read=on_read, read_every=read_every)
    return [Answer(tokens, "stop" if stopped else "length") for tokens, stopped in answers]


def _progress_bar(total: int, done: int, *, desc: str = "generate", disable: bool = False):
    from dflash_pipeline.foundation.progress import progress

    return progress(total=total, initial=done, unit="prompt", desc=desc, disable=disable)


def select_prompts(prompt_set: PromptSet, tokenizer, config: GenerateConfig) -> tuple[list[tuple[Prompt, list[int]]], Counter]:
    """The prompts to answer with their rendered token ids, and the skipped rows by reason. A
    prompt longer than `max_prompt_tokens` in the chat template is a bad row like any other
    (`on_bad_row`): skipped and counted, or one error naming its file:line."""
    skipped = Counter(prompt_set.skipped)
    selected: list[tuple[Prompt, list[int]]] = []
    for prompt in prompt_set.prompts:
        ids = render_prompt(tokenizer, prompt, system_prompt=config.system_prompt, enable_thinking=config.enable_thinking)
        if len(ids) > config.max_prompt_tokens:
            if config.on_bad_row == "error":
                raise PipelineError(f"{prompt_set.source or 'the prompt set'}:{prompt.source_line}: the prompt is {len(ids)} tokens in the "
                                    f"target's chat template, longer than generate.max_prompt_tokens ({config.max_prompt_tokens}); "
                                    "shorten it, or skip such rows with generate.on_bad_row: skip")
            skipped[f"longer than max_prompt_tokens={config.max_prompt_tokens}"] += 1
            continue
        selected.append((prompt, ids))
    return selected, skipped


SPLITS = ("train", "val")


def check_split_sizes(prompts: list[Prompt], *, prompt_set: PromptSet, config: GenerateConfig, what: str) -> None:
    """Refuse a split without a prompt where the split is made, not in train or evaluate later:
    train learns from the train split and scores the val split every eval_every steps."""
    counts = Counter(prompt.split for prompt in prompts)
    for split in SPLITS:
        if counts[split] == 0:
            where = prompt_set.source or "the prompt set"
            raise PipelineError(
                f"generate: {where}: {len(prompts)} {what} give 0 {split} prompts (generate.val_fraction {config.val_fraction}, "
                f"generate.max_prompts {config.max_prompts}); every split needs one: add prompts, change generate.val_fraction, "
                f"or pin a prompt to {split} with a \"split\": \"{split}\" field")


def answer_batches(model, batches: list[list[tuple[Prompt, list[int]]]], cache: "AnswerCache", *, config: GenerateConfig,
                   eos_ids: set[int], pad_id: int, bar) -> int:
    """Answer `batches` one by one, each saved to the cache as it finishes; returns the new tokens."""
    import torch

    new_tokens = 0
    started = time.perf_counter()

    def on_step(tokens: int, finished: int) -> None:
        nonlocal new_tokens
        new_tokens += tokens
        bar.set_postfix_str(f"{new_tokens / max(time.perf_counter() - started, 1e-9):.1f} tok/s", refresh=False)
        bar.update(finished)

    torch.manual_seed(0)  # greedy decoding is deterministic; seeded anyway for any sampling op
    for batch in batches:
        answers = greedy_generate(model, [ids for _, ids in batch], max_new_tokens=config.max_new_tokens, eos_ids=eos_ids,
                                  pad_id=pad_id, on_step=on_step)
        cache.add([{"prompt_id": prompt.id, "category": prompt.category, "split": prompt.split, "messages": prompt.as_messages(),
                    "prompt_ids": ids, "answer_ids": answer.token_ids, "finish_reason": answer.finish_reason}
                   for (prompt, ids), answer in zip(batch, answers)])
    return new_tokens


def write_splits(selected: list[tuple[Prompt, list[int]]], cache: "AnswerCache", *, out_dir: Path, settings: dict) -> dict[str, list[dict]]:
    """train.parquet and val.parquet: the selected prompts' rows, in prompt-file order."""
    splits: dict[str, list[dict]] = {"train": [], "val": []}
    for prompt, _ in selected:
        row = dict(cache.rows[prompt.id])
        row["split"] = prompt.split  # the split is a property of the prompt set, not of the answer
        row["category"] = prompt.category
        splits[prompt.split].append(row)
    for split, rows in splits.items():
        write_parquet_atomic(rows_table(rows, settings), out_dir / f"{split}.parquet")
    return splits


def run_generate(
    prompt_set: PromptSet,
    *,
    config: GenerateConfig,
    target: TargetInfo,
    out_dir: Path,
    device: str = "cpu",
    source: str = "params.yaml",
    placement: TargetPlacement | None = None,
) -> dict | None:
    """Answer every prompt of `prompt_set` (resuming from `out_dir/chunks`); return the summary:
    summary.json's content plus `this_run` (answers reused and made now, seconds, tokens/s).
    `source`: the params file `config` came from, named in configuration errors (settings the
    target's context cannot hold stop the run before anything is written). `placement`: the target
    split over devices (`target.placement`; None: whole on `device`).

    Under torchrun (`launch.processes`) rank r answers batches r, r + world, ... of the one batch
    plan every rank makes alike, so each batch holds the prompts it would hold in one process and
    its answers are the same; rank 0 writes the splits once every rank is done and returns the
    summary, the other ranks None."""
    config.validate_context(target.max_position_embeddings, source)
    check_split_sizes(prompt_set.prompts, prompt_set=prompt_set, config=config, what="prompt(s)")
    check_processes(Ranks.from_environment().world, len(prompt_set.prompts), source)  # before any process waits on another
    device, world, rank = init_distributed(device, devices_per_replica=placement.devices_per_replica if placement else 1)
    try:
        return _generate_as_rank(prompt_set, config=config, target=target, out_dir=out_dir, device=device, source=source,
                                 placement=placement, rank=rank, world=world)
    finally:
        leave_process_group(world)


def check_processes(world: int, prompts: int, source: str) -> None:
    """More processes than prompts would leave a rank without a batch: refused in one line."""
    if world > prompts:
        raise PipelineError(f"{source}: key 'launch.processes' gives {world} processes (torchrun's world size), more than the "
                            f"{prompts} prompt(s) to answer; use at most {prompts}")


def plan_batches(pending: list[tuple[Prompt, list[int]]], batch_size: int) -> list[list[tuple[Prompt, list[int]]]]:
    """The batches `pending` is answered in, the same in every process: longest first, so that
    similar lengths share a batch (little padding) and memory peaks at once."""
    ordered = sorted(pending, key=lambda item: -len(item[1]))
    return [ordered[start : start + batch_size] for start in range(0, len(ordered), batch_size)]


def _generate_as_rank(prompt_set: PromptSet, *, config: GenerateConfig, target: TargetInfo, out_dir: Path, device: str, source: str,
                      placement: TargetPlacement | None, rank: int, world: int) -> dict | None:
    import torch

    from dflash_pipeline.target.load import load_target

    model, tokenizer = load_target(target, device=device, placement=placement)
    selected, skipped = select_prompts(prompt_set, tokenizer, config)  # a bad row stops the run before anything is written
    check_processes(world, len(selected), source)
    compute_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    settings = generation_settings(config, target, compute_dtype, decoding_engine(model))
    cache = AnswerCache(out_dir / "chunks", settings, rank=rank, world=world) if rank == 0 else None
    barrier(world)  # rank 0 has discarded what it could not reuse; the others only read
    if cache is None:
        cache = AnswerCache(out_dir / "chunks", settings, maintain=False, rank=rank, world=world)
    if cache.discarded:
        print(f"generate: settings changed since the cached answers; discarded {cache.discarded} chunk(s)")
    check_split_sizes([prompt for prompt, _ in selected], prompt_set=prompt_set, config=config,
                      what=f"prompt(s) within max_prompt_tokens {config.max_prompt_tokens}")
    pending = [(p, ids) for p, ids in selected if p.id not in cache.rows]
    reused = len(selected) - len(pending)
    if reused and rank == 0:
        print(f"generate: resuming, {reused} of {len(selected)} prompts already answered")
    mine = plan_batches(pending, config.batch_size)[rank::world]
    eos_ids = set(target.eos_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    if world == 1:
        bar = _progress_bar(len(selected), reused)
    else:  # rank 0 shows its own share; the others' run alongside
        bar = _progress_bar(sum(len(batch) for batch in mine), 0, desc=f"generate (rank 0 of {world})", disable=rank != 0)
    started = time.perf_counter()
    try:
        new_tokens = answer_batches(model, mine, cache, config=config, eos_ids=eos_ids, pad_id=pad_id, bar=bar)
    finally:
        bar.close()
    tokens = sum_over_ranks(torch.tensor([new_tokens], dtype=torch.int64, device=device), world)  # NCCL sums device tensors only
    elapsed = time.perf_counter() - started
    barrier(world)  # every rank's chunks are in place
    if rank != 0:
        return None
    cache.read_chunks()
    splits = write_splits(selected, cache, out_dir=out_dir, settings=settings)
    new_tokens = int(tokens[0])
    summary = {
        "prompts": {s: len(rows) for s, rows in splits.items()},
        "answer_tokens": {s: sum(len(r["answer_ids"]) for r in rows) for s, rows in splits.items()},
        "prompt_tokens": {s: sum(len(r["prompt_ids"]) for r in rows) for s, rows in splits.items()},
        "finish_reasons": dict(Counter(r["finish_reason"] for rows in splits.values() for r in rows)),
        "categories": dict(Counter(r["category"] for rows in splits.values() for r in rows)),
        "skipped_rows": dict(skipped),
        "duplicate_prompts": prompt_set.duplicates,
        "settings": settings,
        "config": as_dict(config),
    }
    write_json_atomic(out_dir / "summary.json", summary)
    summary["this_run"] = {"reused_answers": reused, "prompts": len(pending), "new_tokens": new_tokens, "seconds": round(elapsed, 2),
                           "tokens_per_s": round(new_tokens / elapsed, 2) if elapsed > 0 and new_tokens else None,
                           "processes": world}
    return summary
