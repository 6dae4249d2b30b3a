"""A new drafter for a target: its sizes from the target's config, its mask token, its first weights.

The drafter copies the target's layer shapes (hidden size, heads, RoPE base) so that the frozen
embedding and LM head fit; the mask token is an embedding row no real token uses, else a special
token absent from the data; the weights are random or the target's top layers (`train.init`).
"""

from dataclasses import dataclass

from dflash_pipeline.drafters import family
from dflash_pipeline.drafters.config import DrafterConfig, DrafterOptions, DrafterSizeError
from dflash_pipeline.drafters.core import DFlashDrafter
from dflash_pipeline.foundation.config import TrainConfig, as_dict
from dflash_pipeline.foundation.errors import PipelineError
from dflash_pipeline.target.folder import read_tensors
from dflash_pipeline.target.load import TargetInfo


# Train keys left out of the run's record: a run resumes across a change of them.
RUNTIME_ONLY_KEYS = ("compile",)


@dataclass(frozen=True)
class ArchitectureChoice:
    """The run's architecture and its resolved options (`train.architecture`, `train.options.<name>`)."""

    member: object  # drafters.architecture.Architecture
    options: DrafterOptions  # member.options_type: part of the drafter's config
    loss_options: object  # member.loss_options_type: training only

    def record(self, config: TrainConfig) -> dict:
        """The train config as a run's record holds it (resume compares it): every shared key and
        the chosen architecture's options, resolved (plain DFlash adds nothing, so checkpoints made
        before there was a family still count as the same run)."""
        data = as_dict(config)
        del data["architecture"], data["options"]
        for key in RUNTIME_ONLY_KEYS:  # they change how fast a step runs, not what it computes
            del data[key]
        return {**data, **self.member.record(self.options, self.loss_options)}


def choose_architecture(config: TrainConfig, *, source: str = "params.yaml") -> ArchitectureChoice:
    """The member `train.architecture` names, with its options from `train.options`: a name the
    family does not know, or a bad option of any architecture listed there, stops with its key."""
    name = config.architecture if config.architecture is not None else family.DEFAULT
    if name not in family.names():
        raise PipelineError(f"{source}: key 'train.architecture' must be one of {', '.join(family.names())}, got {name!r}")
    unknown = sorted(set(config.options) - set(family.names()))
    if unknown:
        raise PipelineError(f"{source}: unknown key 'train.options.{unknown[0]}' (architectures: {', '.join(family.names())})")
    for listed, raw in config.options.items():  # the others too: a typo in one is caught before it is chosen
        family.architecture(listed).train_options(raw, source=source)
    member = family.architecture(name)
    options, loss_options = member.train_options(config.options.get(member.name), source=source)
    return ArchitectureChoice(member, options, loss_options)


def choose_mask_token(target: TargetInfo, used_ids: set[int]) -> tuple[int, str]:
    """An embedding row no real token uses, else a special token that never occurs in the data."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target.path)
    if target.vocab_size > len(tokenizer):
        return len(tokenizer), f"first unused embedding row ({len(tokenizer)} tokens, {target.vocab_size} rows)"
    special = sorted(set(tokenizer.all_special_ids) | {i for i in tokenizer.added_tokens_decoder if i < target.vocab_size})
    eos = set(target.eos_token_ids)
    for token_id in sorted(special, key=lambda i: (i in eos, i == tokenizer.pad_token_id, i)):
        if token_id not in used_ids and token_id not in eos:
            return token_id, f"special token {tokenizer.convert_ids_to_tokens(token_id)!r}, absent from the data"
    raise PipelineError("train.mask_token_id: no unused embedding row and every special token occurs in the data; set it explicitly")


def drafter_config_for(target: TargetInfo, config: TrainConfig, *, layer_ids: list[int], mask_token_id: int, extra: dict,
                       source: str = "params.yaml") -> DrafterConfig:
    """Sizes copied from the target's config.json; depth, block and architecture from the train params."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(target.path)
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    choice = choose_architecture(config, source=source)
    try:
        return DrafterConfig(
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_layers=config.num_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", text.num_attention_heads),
            head_dim=head_dim,
            vocab_size=text.vocab_size,
            block_size=config.block_size,
            target_layer_ids=tuple(layer_ids),
            num_target_layers=target.num_layers,
            mask_token_id=mask_token_id,
            rms_norm_eps=float(text.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 32768)),
            sliding_window=config.sliding_window,
            extra=extra,
            architecture=choice.member.name,
            options=choice.options,
        )
    except DrafterSizeError as exc:  # an option the architecture refuses for this target's sizes (e.g. a top-K over the vocabulary)
        raise PipelineError(f"{source}: key 'train.options.{choice.member.name}.{exc.key}' {exc.why} for the target {target.path}, "
                            f"got {exc.value!r}") from None


def init_from_target_layers(drafter: DFlashDrafter, target: TargetInfo) -> list[int]:
    """Copy the target's top decoder layers into the drafter's layers (norms and projections).

    Only those layers' tensors are read. q_norm / k_norm stay at one where the target has none.
    """
    count = len(drafter.layers)
    source_layers = list(range(target.num_layers - count, target.num_layers))
    wanted = []
    names = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
             "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
    for source in source_layers:
        wanted += [f"layers.{source}.{name}" for name in names]
    tensors = read_tensors(target.path, wanted)
    state = drafter.state_dict()
    for own_index, source in enumerate(source_layers):
        for name in names:
            tensor = tensors.get(f"layers.{source}.{name}")
            if tensor is not None:
                state[f"layers.{own_index}.{name}"] = tensor.to(state[f"layers.{own_index}.{name}"].dtype)
    drafter.load_state_dict(state)
    return source_layers


def new_drafter(config: TrainConfig, target: TargetInfo, drafter_config: DrafterConfig) -> tuple[DFlashDrafter, str]:
    """A drafter with fresh weights (`train.init`), and a note saying how it was initialised."""
    drafter = DFlashDrafter(drafter_config)
    if config.init != "target_top_layers":
        return drafter, "random"
    note = f"target layers {init_from_target_layers(drafter, target)} and final norm"
    # The frozen head reads what the target's final norm produces; start the drafter's there.
    final_norm = read_tensors(target.path, ["norm.weight"]).get("norm.weight")
    if final_norm is not None and final_norm.shape == drafter.norm.weight.shape:
        drafter.norm.weight.data.copy_(final_norm.float())
    return drafter, note
