"""The interface every drafter architecture implements; its defaults are plain DFlash.

A member (one module each: `dflash`, `dflash2`) subclasses `Architecture`, overrides what it
changes and registers itself with `family.register`. The shared mechanics call these hooks:

    options          `options_type` (model sizes, in DrafterConfig) and `loss_options_type`
                     (training-only weights), read from `train.options.<name>` with their checks
    layers           `sublayer_wrappers` around attention and MLP, `extra_modules` beside the core
    drafting         `draft_chain`: the chain of a drafted block (T = 0 and both sampling rules),
                     on the device; trees are built by shared code from the head's logits
                     (`speculation.trees`), so a member writes drafting once
    training         `loss_top_k` and `extra_loss` beside the drafted slots' cross-entropy, and
                     `curve_fields` (what the extra term adds to the training curve)
    scoring          `score_blocks` (which drafted slots count as correct, and per-block extras),
                     `summarize_extras` (their metrics, named by the member)
    serving          `public_class`, `public_weight_names`, `weight_aliases`, `serving_fields`
                     and `options_from_serving` (the public DFlash format's config and tensors)

Nothing outside the drafters wing tests an architecture's name: it asks `drafter.architecture`
or `family.architecture(name)`.
"""

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

from dflash_pipeline.drafters import family
from dflash_pipeline.drafters.config import DrafterConfig, DrafterOptions
from dflash_pipeline.drafters.core import DFlashDrafter, draft_logits
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.speculation.sampling import Sampling, draw_with_uniforms, sampling_probs


@dataclasses.dataclass(frozen=True)
class NoOptions(DrafterOptions):
    """An architecture without options of its own."""


class Architecture:
    name: str = ""
    title: str = ""  # how people write its name, e.g. "DFlash2" (`dflash-pipeline show`: "DFlash2 drafter")
    public_class: str = ""  # the serving format's `architectures` entry, e.g. "DFlashDraftModel"
    options_type: type[DrafterOptions] = NoOptions  # sizes that are part of the drafter (DrafterConfig.options)
    loss_options_type: type = NoOptions  # frozen dataclass: training-only weights (never in the drafter)

    def __init_subclass__(cls, **kwargs):
        """A member's options are a frozen `DrafterOptions` dataclass, stored under its name beside
        the shared fields (`DrafterConfig.to_dict`): a name that is a shared field would clash."""
        super().__init_subclass__(**kwargs)
        options_type = cls.options_type
        if not (isinstance(options_type, type) and issubclass(options_type, DrafterOptions)
                and dataclasses.is_dataclass(options_type) and options_type.__dataclass_params__.frozen):
            raise TypeError(f"{cls.__name__}.options_type must be a frozen dataclass subclassing DrafterOptions, got {options_type!r}")
        if cls.name in DrafterConfig.shared_fields() | {"architecture", "options"}:
            raise TypeError(f"{cls.__name__}.name {cls.name!r} is a DrafterConfig field; a member's options are stored under its name")

    # ------------------------------------------------------------------ options

    def options_from(self, value):
        """`value` (None, a mapping, or already `options_type`) as `options_type`, defaults filled in;
        another member's options are a ValueError."""
        if isinstance(value, self.options_type):
            return value
        if isinstance(value, DrafterOptions):
            raise ValueError(f"{self.name} takes {self.options_type.__name__}, got {type(value).__name__}")
        value = dict(value or {})
        known = {f.name for f in dataclasses.fields(self.options_type)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{self.name} has no option {unknown[0]!r} (its options: {', '.join(sorted(known)) or 'none'})")
        return self.options_type(**value)

    def option_checks(self, options, loss_options) -> list[tuple[str, bool, str]]:
        """(key, ok, why) for every option this architecture checks on its own, sizes apart (`check`):
        the one list of what a value of `train.options.<name>` may be (tests walk it)."""
        return []

    def option_problems(self, options, loss_options) -> list[tuple[str, str]]:
        """(key, why) for every option value out of range, sizes apart (`check`)."""
        return [(key, why) for key, ok, why in self.option_checks(options, loss_options) if not ok]

    def check(self, config: DrafterConfig) -> tuple[str, str] | None:
        """What is wrong with these sizes for this architecture, as (option key, why): e.g.
        ("conv_group_size", "must divide hidden_size 64"); or None."""
        return None

    def train_options(self, raw: Mapping | None, *, source: str):
        """(options, loss_options) from `train.options.<name>` of a params file: missing keys take
        their defaults; unknown keys, wrong types and values out of range stop with the key's name."""
        from dflash_pipeline.foundation.config import section_from_dict

        raw = dict(raw or {})
        section = f"train.options.{self.name}"
        option_keys = {f.name for f in dataclasses.fields(self.options_type)}
        loss_keys = {f.name for f in dataclasses.fields(self.loss_options_type)}
        unknown = sorted(set(raw) - option_keys - loss_keys)
        if unknown:
            raise PipelineError(f"{source}: unknown key '{section}.{unknown[0]}' (known: {', '.join(sorted(option_keys | loss_keys)) or 'none'})")
        options = section_from_dict(self.options_type, {k: v for k, v in raw.items() if k in option_keys}, section=section,
                                    source=source, partial=True)
        loss_options = section_from_dict(self.loss_options_type, {k: v for k, v in raw.items() if k in loss_keys}, section=section,
                                         source=source, partial=True)
        for key, why in self.option_problems(options, loss_options):
            value = raw.get(key, getattr(options, key, getattr(loss_options, key, None)))
            raise PipelineError(f"{source}: key '{section}.{key}' {why}, got {value!r}")
        return options, loss_options

    def record(self, options, loss_options) -> dict:
        """The architecture's part of a training run's record (resume compares it): its name and
        every option; plain DFlash records nothing, as before the family existed."""
        values = {**dataclasses.asdict(options), **dataclasses.asdict(loss_options)}
        return {"architecture": self.name, **values} if values or self.name != family.UNNAMED else {}

    # ------------------------------------------------------------------ layers

    def sublayer_wrappers(self, config: DrafterConfig) -> tuple:
        """(around attention, around the MLP): modules with `prepare(blocks) -> (x, state)` and
        `finish(y, state)`, working on [blocks, B, H] (never across blocks), or None."""
        return None, None

    def extra_modules(self, config: DrafterConfig) -> dict:
        """Modules the drafter holds beside the core layers, by attribute name (= public name prefix)."""
        return {}

    # ------------------------------------------------------------------ drafting

    def draft_chain(self, drafter: DFlashDrafter, head, hidden: torch.Tensor, anchor: torch.Tensor,
                    sampling: Sampling | None = None, uniforms: torch.Tensor | None = None):
        """The member's one drafting hook: the chain of a block already drafted into `hidden`
        [n, H] after `anchor` [1], on the device (`decoding.static_speculation`): token ids [n],
        each slot's argmax at T = 0 and under the "match" rule; under "ratio" a draw from each
        slot's q at the sampling temperature, with q [n, V] over the full vocabulary (zero outside
        a draft vocabulary). Draws invert each slot's CDF at `uniforms` [n]
        (`sampling.draw_with_uniforms`), so nothing here reads back or holds a generator."""
        logits = draft_logits(drafter, head, hidden)
        if sampling is None or sampling.rule == "match":
            return drafter.vocab_tokens(logits.argmax(-1)), None
        columns = sampling_probs(logits, sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        tokens = drafter.vocab_tokens(draw_with_uniforms(columns, uniforms))
        if not drafter.has_draft_vocab:
            return tokens, columns
        q = columns.new_zeros(columns.shape[0], head.lm_head_weight.shape[0])
        return tokens, q.index_copy_(1, drafter.draft_vocab.to(q.device), columns)

    # ------------------------------------------------------------------ training

    def loss_top_k(self, config: DrafterConfig, loss_options) -> int:
        """How many best columns per slot the chunked cross-entropy should hand to `extra_loss` (0: none)."""
        return 0

    def extra_loss(self, drafter: DFlashDrafter, *, hidden, head_rows, top_columns, labels, predecessors, weights, token_ids,
                   loss_options):
        """A weighted term added to the slots' summed cross-entropy (same weights and normaliser),
        and its statistics as device tensors (read by `curve_fields` when a curve row is logged):
        (term or None, {name: tensor})."""
        return None, {}

    def curve_fields(self, stats: dict) -> dict:
        """Training-curve fields from `extra_loss`'s statistics (summed over the step)."""
        return {}

    # ------------------------------------------------------------------ scoring

    def score_blocks(self, drafter: DFlashDrafter, *, hidden, logits, anchors, labels, valid):
        """Teacher-forced blocks hidden [n, B-1, H], logits [n, B-1, V] (read-only), anchor and
        label token ids [n] / [n, B-1], valid [n, B-1] -> (correct [n, B-1] numpy, or None for each
        slot's argmax; {extra name: array [n, B-1]} for `summarize_extras`)."""
        return None, {}

    def summarize_extras(self, scores) -> dict[str, float]:
        """Metrics of this architecture's extra arrays (`scores.extras`), named by the member."""
        return {}

    # ------------------------------------------------------------------ serving

    def public_weight_names(self, num_layers: int) -> tuple[list[str], list[str]]:
        """Tensor names this architecture adds to the public format: (per layer, after `layers.i.`; global)."""
        return [], []

    weight_aliases: dict = {}  # published spellings of a tensor -> ours

    def serving_fields(self, config: DrafterConfig) -> dict:
        """What config.json's `dflash_config` holds for this architecture beside the shared keys."""
        return {}

    def options_from_serving(self, dflash_config: dict, config: dict, *, where) -> dict:
        """The architecture's options from a serving config.json (its `dflash_config` first, then
        the top level, as z-lab reads them); PipelineError naming `where` when one is missing."""
        return {}


def correct_argmax(drafter: DFlashDrafter, logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> np.ndarray:
    """Each slot's own argmax is the label (token ids) and the slot exists: DFlash's rule."""
    return ((drafter.vocab_tokens(logits.argmax(-1)) == labels) & valid).cpu().numpy()
