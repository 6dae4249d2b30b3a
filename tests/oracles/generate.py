"""The generate stage's batch loop as it was before the static engine: the reference it is tested against.

`dynamic_greedy_generate` decodes a left-padded batch over transformers' own forward and a
DynamicCache, dropping finished rows from the cache. The package's `generate.run.static_greedy_generate`
must answer every prompt exactly as it does.
"""

import torch
from transformers import DynamicCache

from dflash_pipeline.decoding.static_decoder import cache_argument
from dflash_pipeline.generate.run import Answer, left_padded


def dynamic_greedy_generate(model, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: set[int], pad_id: int,
                            on_step=None) -> list[Answer]:
    """Greedy-decode a batch of prompts with left padding and a shared KV cache over transformers'
    own forward: the reference `generate.run.static_greedy_generate` is tested against
    (tests/decoding/test_static_decoder.py) and timed against on a GPU (bench/gpu/figures.py's decode section).

    Rows that finish leave the batch (their cache rows are dropped), so a long answer does not
    make short ones pay for its steps. `on_step(new_tokens, finished_rows)` reports progress.
    """
    device = next(model.parameters()).device
    input_ids, attention = left_padded(prompts, pad_id)
    batch = input_ids.shape[0]
    input_ids, attention = input_ids.to(device), attention.long().to(device)
    positions = attention.sum(-1)  # position of the next token per row
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
            **cache_argument(model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        next_tokens = out.logits[:, -1].argmax(-1)
        active = list(range(batch))  # original row of each row still in the batch
        answers: list[list[int]] = [[] for _ in range(batch)]
        finish: list[str | None] = [None] * batch
        while True:
            keep = []
            for row, token in enumerate(next_tokens.tolist()):
                original = active[row]
                answers[original].append(token)
                if token in eos_ids:
                    finish[original] = "stop"
                elif len(answers[original]) >= max_new_tokens:
                    finish[original] = "length"
                else:
                    keep.append(row)
            if on_step is not None:
                on_step(len(active), len(active) - len(keep))
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                attention, positions, next_tokens = attention[index], positions[index], next_tokens[index]
                active = [active[row] for row in keep]
            attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=1)
            out = model(
                input_ids=next_tokens[:, None],
                attention_mask=attention,
                position_ids=positions[:, None],
                **cache_argument(model, cache),
                use_cache=True,
            )
            positions = positions + 1
            next_tokens = out.logits[:, -1].argmax(-1)
    return [Answer(token_ids=answers[row], finish_reason=finish[row]) for row in range(batch)]
