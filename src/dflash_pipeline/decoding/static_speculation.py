"""The engine's steps on static buffers: a whole decode step kept on the device.

The host loops this replaced (tests/oracles/decoding.py) read the device about five times per
step (the drafted tokens, the target's choices, the accepted count), built a DDTree in Python,
grew their caches by concatenation and kept a tree's path with one tensor per layer: on an H200
that made a step cost tens of milliseconds of host work. Here every tensor a step touches is
preallocated and every decision stays on the device:

    StaticDraftCache   the drafter's context keys/values [layers, length, kv heads, head dim],
                       written at device-side columns; attention masks what lies past the context
    SpeculativeStep    three phases per step, each with fixed shapes:
                         draft   the block after the anchor, its chain (`Architecture.draft_chain`)
                                 or its DDTree (`trees.build_draft_tree_tensors`)
                         verify  [anchor, nodes] in one target forward over a static KV cache
                                 (`StaticDecoder.forward`, tree visibility as a mask), the accepted
                                 path and the bonus token chosen on the device (`acceptance`)
                         extend  the tree's path moved into place in the target cache (one gather
                                 for all layers), the committed features into the drafter's cache,
                                 the answer, the counters and the end flag
    Speculation        one drafter in one `DecodingMode` (a chain of `verify_tokens`, or a DDTree of
                       `tree_budget` nodes); `decode` runs one prompt on a step kept per mode and reused across
                       prompts, through the engine's one loop (`loop.run_steps`, which also drives
                       the plain step, `loop.PlainStep`)

A chain is a tree whose node i hangs under node i - 1, so one verify and one acceptance serve
both. Committing never crops: a position past the committed length is masked, and the next step
overwrites it. Once an answer has ended, steps still run until the next read, but change nothing
that is read (`ended` freezes every counter).

Sampling (T > 0, chains) draws by inverting CDFs at uniforms the step takes as an input, filled by
a seeded device generator before each step (`sampling.draw_with_uniforms`), so no step holds a
generator and graph capture or compilation sees plain tensors. The draws differ from the host
loop's, the distributions do not.

On CUDA each phase is captured once as a CUDA graph and replayed (`graphs.PhaseRunner`). This part
of the module has not yet run on a GPU.
"""

from dataclasses import dataclass

import torch

from dflash_pipeline.decoding.loop import StepRecord, cached_step, run_prompt, steps_of
from dflash_pipeline.speculation.modes import DecodingMode
from dflash_pipeline.speculation.sampling import Sampling, draw_with_uniforms, sampling_probs
from dflash_pipeline.decoding.static_decoder import StaticDecoder
from dflash_pipeline.speculation.trees import (RankPathKeys, build_draft_tree_tensors, ranked_candidates_on_device,
                                             tree_attention_visibility)
from dflash_pipeline.foundation.devices import READ_EVERY, bf16_by_default
from dflash_pipeline.drafters.core import DFlashDrafter, draft_logits
from dflash_pipeline.decoding.acceptance import accept_greedy, accept_sampled
from dflash_pipeline.target.placement import is_split, model_device


def _autocast(device: torch.device, enabled: bool):
    # Graph capture cannot keep autocast's weight-cast cache: every replay casts afresh.
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled, cache_enabled=False)


class StaticDraftCache:
    """The drafter's context keys/values of one sequence in preallocated tensors."""

    def __init__(self, drafter: DFlashDrafter, *, length: int, device, dtype: torch.dtype):
        config = drafter.config
        shape = (len(drafter.layers), length, config.num_key_value_heads, config.head_dim)
        self.drafter = drafter
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.key_columns = torch.arange(length, device=device)

    def write(self, features: torch.Tensor, start: torch.Tensor) -> None:
        """The context keys/values of features [n, N*H] at positions start, start + 1, ... (`start` a
        device scalar), written at the columns of those positions."""
        drafter = self.drafter
        positions = start + torch.arange(features.shape[0], device=features.device)
        context = drafter.project_context(features)
        cos, sin = drafter._rope(positions, context.dtype)
        for index, layer in enumerate(drafter.layers):
            key, value = layer.self_attn.keys_values(context, cos, sin)
            self.keys[index].index_copy_(0, positions, key.to(self.keys.dtype))
            self.values[index].index_copy_(0, positions, value.to(self.values.dtype))

    def hidden(self, head, anchor: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [B-1, H] of the slots after `anchor` [1] at position `start`:
        `core.DFlashDrafter.forward_blocks` for one block over the static cache (context = the columns before `start`)."""
        drafter, config = self.drafter, self.drafter.config
        block = config.block_size
        device = self.keys.device
        ids = torch.cat([anchor, torch.full((block - 1,), config.mask_token_id, dtype=torch.long, device=device)])
        x = head.embed(ids).to(drafter.fc.weight.dtype)
        rope_block = drafter._rope(start + torch.arange(block, device=device), x.dtype)
        context = self.key_columns < start
        if config.sliding_window is not None:
            context = context & (self.key_columns >= start - config.sliding_window)
        mask = torch.cat([context[None].expand(block, -1), torch.ones(block, block, dtype=torch.bool, device=device)], dim=1)
        for index, layer in enumerate(drafter.layers):
            x = layer(x, None, rope_block, None, mask, cached_kv=(self.keys[index], self.values[index]))
        return drafter.norm(x)[1:]


def stored_features(features: torch.Tensor, feature_dtype: str) -> torch.Tensor:
    """Live target features rounded exactly as the shards store them, so the drafter sees at
    inference what it saw in training: on the device (bf16 and fp8 alike), so capture can keep it."""
    from dflash_pipeline.data.shards import round_as_stored

    return round_as_stored(features, feature_dtype)


class _Loop:
    """The speculative step's bookkeeping of one answer: its buffer, counters and end flag, all on the device."""

    def _allocate_answer(self, max_new_tokens: int, per_step: int, eos_ids: set[int]) -> None:
        device = self.device
        # The longest answer this step holds; a prompt's own cap (`prefill`) is a device value, so
        # one step (and its graphs) serves every cap up to it.
        self.answer_capacity = self.max_new_tokens = max_new_tokens
        self.limit = torch.full((), max_new_tokens, dtype=torch.long, device=device)
        self.answer = torch.zeros(max_new_tokens + per_step + 1, dtype=torch.long, device=device)
        self.count = torch.zeros((), dtype=torch.long, device=device)  # answer tokens committed
        self.ended = torch.zeros((), dtype=torch.bool, device=device)
        self.eos = torch.tensor(sorted(eos_ids) or [-1], dtype=torch.long, device=device)
        self.step_number = torch.zeros((), dtype=torch.long, device=device)
        self.step_sizes = torch.zeros(max_new_tokens + READ_EVERY + 1, dtype=torch.long, device=device)
        self.drafted_sizes = torch.zeros_like(self.step_sizes)

    def _commit(self, committed: torch.Tensor, made: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        """Append `committed` [n] (of which the first `made` count) to the answer unless it has
        ended; returns how far the sequence advances (0 once ended)."""
        slots = torch.arange(committed.shape[0], device=self.device)
        spots = self.count + slots
        self.answer.index_copy_(0, spots.clamp(max=self.answer.shape[0] - 1), committed)
        counts = slots < made
        is_eos = (committed[:, None] == self.eos[None, :]).any(-1)
        finished = ((is_eos | (spots + 1 >= self.limit)) & counts).any()
        live = ~self.ended
        advance = torch.where(live, made, 0)
        at = self.step_number.clamp(max=self.step_sizes.shape[0] - 1).view(1)
        self.step_sizes.index_copy_(0, at, advance.view(1))
        self.drafted_sizes.index_copy_(0, at, torch.where(live, drafted, 0).view(1))
        self.step_number.add_(1)
        self.count.add_(advance)
        self.ended.logical_or_(finished)
        return advance

    def graph_state(self) -> list[torch.Tensor]:
        """The counters a warm-up run moves and the next prompt's prefill would not reset."""
        return [self.count, self.ended, self.step_number]

    def _start_answer(self, first: torch.Tensor, max_new_tokens: int) -> None:
        """Fresh counters and the first answer token [1] of a prompt capped at `max_new_tokens`."""
        if max_new_tokens > self.answer_capacity:
            raise ValueError(f"max_new_tokens {max_new_tokens} exceeds this step's answer capacity {self.answer_capacity}")
        self.max_new_tokens = max_new_tokens
        self.limit.fill_(max_new_tokens)
        for counter in (self.count, self.step_number, self.step_sizes, self.drafted_sizes):
            counter.zero_()
        self.answer[0] = first[0]
        self.count.fill_(1)
        self.ended.copy_((first == self.eos).any() | (self.limit <= 1))

    def read_state(self) -> tuple[bool, int]:
        ended, count = torch.stack([self.ended.long(), self.count]).tolist()  # the one read between steps
        return bool(ended), count

    def answer_tokens(self, start: int, stop: int) -> list[int]:
        """Answer tokens start..stop (what streaming shows)."""
        return self.answer[start : min(stop, self.max_new_tokens)].tolist()

    def record(self) -> StepRecord:
        count, steps, *rest = torch.cat([self.count.view(1), self.step_number.view(1), self.answer]).tolist()
        answer = rest[: min(count, self.max_new_tokens)]
        stop = next((i for i, token in enumerate(answer) if token in self.eos_set), None)
        answer = answer if stop is None else answer[: stop + 1]
        sizes = torch.stack([self.step_sizes, self.drafted_sizes]).tolist()
        steps = min(steps, self.step_sizes.shape[0])
        made = [size for size in sizes[0][:steps] if size > 0]
        return StepRecord(tokens=answer, steps=made, drafted=sum(sizes[1][:steps]))


class SpeculativeStep(_Loop):
    """One prompt's speculative decoding state and its three phases (see the module docstring).

    `mode`: a chain of `verify_tokens` drafted tokens (default B-1), greedy or sampled under
    `sampling`'s rule; or a DDTree of `tree_budget` nodes (greedy only: `DecodingMode.check_sampling`).
    The mode is resolved here, once: the phases read only the shapes and the flag it sets.
    """

    def __init__(self, model, drafter: DFlashDrafter, head, *, capacity: int, max_new_tokens: int, eos_ids: set[int],
                 mode: DecodingMode = DecodingMode.chain(), sampling: Sampling | None = None, feature_dtype: str = "bf16",
                 bf16: bool | None = None):
        mode.check_sampling(sampling)
        config = drafter.config
        slots = config.block_size - 1
        self.model, self.drafter, self.head = model, drafter, head
        self.device = model_device(model)
        self.split = is_split(model)  # never captured as CUDA graphs (`target.placement`)
        self.bf16 = bf16_by_default(self.device) if bf16 is None else bf16
        self.mode, self.sampling, self.feature_dtype = mode, sampling, feature_dtype
        self.is_tree = mode.is_tree
        self.nodes, self.depth = mode.verified(slots)  # a tree: its budget of nodes
        self.generator = None  # a sampled decode's device generator (`loop.run_prompt` seeds it)
        nodes, device = self.nodes, self.device
        # the prompt, every answer token, and one verify's columns past them
        self.capacity = capacity
        length = capacity + max_new_tokens + self.depth + nodes + 2
        self.target = StaticDecoder(model, batch=1, length=length, tap_layers=tuple(config.target_layer_ids))
        draft_dtype = torch.bfloat16 if self.bf16 else drafter.fc.weight.dtype
        self.drafts = StaticDraftCache(drafter, length=length, device=device, dtype=draft_dtype)
        self._allocate_answer(max_new_tokens, self.depth + 1, eos_ids)
        self.eos_set = set(eos_ids)
        self.start = torch.zeros((), dtype=torch.long, device=device)  # the anchor's position
        self.anchor = torch.zeros(1, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(2 * nodes + 2, device=device)
        # the proposal, in buffers the verify phase reads (a chain: node i under node i - 1)
        chain_parents = torch.arange(nodes, device=device) - 1
        self.node_tokens = torch.zeros(nodes, dtype=torch.long, device=device)
        self.node_parents = chain_parents.clone()
        self.node_depths = torch.arange(nodes, device=device)
        self.node_count = torch.full((), nodes, dtype=torch.long, device=device)
        self.visibility = tree_attention_visibility(chain_parents, 0, self.depth)
        if self.is_tree:  # the rank-path keys' place values, made here: a graph capture cannot copy from the host
            width = min(nodes, drafter.draft_head_weight(head).shape[0])
            self.place = RankPathKeys.for_sizes(slots, width, nodes).place_values(device)
        self.q = None
        if sampling is not None and sampling.rule == "ratio":
            self.q = torch.zeros(nodes, head.lm_head_weight.shape[0], device=device)
        # what verify hands to extend
        self.path = torch.zeros(self.depth, dtype=torch.long, device=device)
        self.accepted = torch.zeros((), dtype=torch.long, device=device)
        self.bonus = torch.zeros(1, dtype=torch.long, device=device)
        self.features = None

    # ------------------------------------------------------------------ per prompt

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int], generator: torch.Generator | None = None, max_new_tokens: int | None = None) -> None:
        """Start a prompt: its KV and features, the first answer token, fresh counters."""
        if len(prompt_ids) > self.capacity:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens is longer than this step's capacity {self.capacity}")
        device = self.device
        ids = torch.tensor([prompt_ids], device=device)
        logits = self.target.prefill(ids, torch.ones_like(ids, dtype=torch.bool))[0]
        if self.sampling is None:
            first = logits.argmax(-1, keepdim=True)
        else:
            uniform = torch.rand(1, generator=generator, device=device)
            first = draw_with_uniforms(self._probs(logits[None]), uniform)
        with _autocast(device, self.bf16):
            self.drafts.write(stored_features(self.target.features[0], self.feature_dtype), torch.zeros((), dtype=torch.long, device=device))
        self.start.fill_(len(prompt_ids))
        self.anchor.copy_(first)
        self._start_answer(first, max_new_tokens or self.answer_capacity)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        sampling = self.sampling
        return sampling_probs(logits, sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)

    # ------------------------------------------------------------------ the phases

    def draft(self) -> None:
        drafter, head = self.drafter, self.head
        with torch.no_grad(), _autocast(self.device, self.bf16):
            hidden = self.drafts.hidden(head, self.anchor, self.start)
            if self.is_tree:
                logprobs, columns = ranked_candidates_on_device(draft_logits(drafter, head, hidden), self.nodes)
                tree = build_draft_tree_tensors(logprobs, drafter.vocab_tokens(columns), self.nodes, place=self.place)
                self.node_tokens.copy_(tree.tokens)
                self.node_parents.copy_(tree.parents)
                self.node_depths.copy_(tree.depths)
                self.node_count.copy_(tree.count)
                self.visibility.copy_(tree_attention_visibility(tree.parents, 0, self.depth))
            else:
                uniforms = self.uniforms[self.nodes + 1 : 2 * self.nodes + 1]
                tokens, q = drafter.architecture.draft_chain(drafter, head, hidden[: self.nodes], self.anchor, self.sampling, uniforms)
                self.node_tokens.copy_(tokens)
                if self.q is not None:
                    self.q.copy_(q)

    def verify(self) -> None:
        target, nodes, device = self.target, self.nodes, self.device
        start = self.start
        with torch.no_grad():
            tokens = torch.cat([self.anchor, self.node_tokens])
            offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=device), 1 + self.node_depths.clamp(min=0)])
            columns = start + torch.arange(nodes + 1, device=device)
            relative = target.key_columns - start
            new = (relative >= 0) & (relative <= nodes)
            visible = (target.key_columns < start)[None] | (self.visibility[:, relative.clamp(0, nodes)] & new[None])
            hidden = target.forward(tokens[None], (start + offsets)[None], columns, visible[None])
            logits = target.logits(hidden[0])
            self.features = target.features[0]
            if self.sampling is None:
                self._accept_greedy(logits.argmax(-1))
            else:
                self._accept_sampled(self._probs(logits))

    def _accept_greedy(self, choice: torch.Tensor) -> None:
        count, path, bonus = accept_greedy(choice, self.node_tokens, self.node_parents, self.node_depths, self.depth)
        self.path.copy_(path)
        self.bonus.copy_(bonus)
        self.accepted.copy_(count)

    def _accept_sampled(self, p: torch.Tensor) -> None:
        count, bonus = accept_sampled(p, self.node_tokens, self.q, self.uniforms[: self.nodes + 1], self.sampling.rule)
        self.path.copy_(torch.arange(self.depth, device=self.device))
        self.bonus.copy_(bonus)
        self.accepted.copy_(count)

    def extend(self) -> None:
        device, depth, start = self.device, self.depth, self.start
        with torch.no_grad():
            count, path = self.accepted, self.path
            slots = torch.arange(depth + 1, device=device)
            committed = torch.where(slots == count, self.bonus, torch.cat([self.node_tokens.gather(0, path), self.bonus]))
            if self.is_tree:  # the accepted nodes' keys/values to the columns after the anchor, in order
                self.target.move_columns(start + 1 + slots[:depth], start + 1 + path)
            rows = torch.cat([torch.zeros(1, dtype=torch.long, device=device), 1 + path])  # the anchor and the accepted nodes
            with _autocast(device, self.bf16):
                self.drafts.write(stored_features(self.features.index_select(0, rows), self.feature_dtype), start)
            drafted = self.node_count
            advance = self._commit(committed, count + 1, drafted)
            self.start.add_(advance)
            self.anchor.copy_(torch.where(advance > 0, self.bonus, self.anchor))

    def phases(self):
        return (self.draft, self.verify, self.extend)

    def graph_state(self) -> list[torch.Tensor]:
        return super().graph_state() + [self.start, self.anchor]


@dataclass(frozen=True, eq=False)
class Speculation:
    """One drafter in one decoding mode on the static step: a chain of `verify_tokens` (None: B-1),
    or a DDTree of `tree_budget` nodes. Whether and how a chain samples is each decode's `sampling`."""

    drafter: DFlashDrafter
    head: object
    mode: DecodingMode = DecodingMode.chain()

    @torch.inference_mode(False)
    def decode(self, model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int], feature_dtype: str = "bf16",
               bf16: bool | None = None, sampling: Sampling | None = None, on_tokens=None, read_every: int | None = None):
        """`session.speculative_decode` of one prompt on the static step (a `DecodeRun`): greedy, or
        a sampled chain under `sampling` (its rule, temperature and seed)."""
        sampling_key = None if sampling is None else (sampling.temperature, sampling.rule, sampling.top_k, sampling.top_p)
        layout = self.drafter.draft_layout  # a draft vocabulary of another length makes every kept step stale
        key = (id(model), tuple(sorted(eos_ids)), feature_dtype, bf16, sampling_key, layout)
        steps = steps_of(self)
        for stale in [kept for kept in steps if kept[-1] != layout]:
            del steps[stale]

        def build(capacity, answer_capacity):
            return SpeculativeStep(model, self.drafter, self.head, capacity=capacity, max_new_tokens=answer_capacity, eos_ids=eos_ids,
                                   mode=self.mode, sampling=sampling, feature_dtype=feature_dtype, bf16=bf16)

        step, runner = cached_step(self, key, len(prompt_ids), max_new_tokens, build)
        return run_prompt(step, runner, prompt_ids, max_new_tokens, sampling, on_tokens, read_every)
