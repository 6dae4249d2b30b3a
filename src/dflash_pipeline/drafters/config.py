"""A drafter's configuration: the shared sizes every member of the family has, and the member's
own typed options, with their one serialised layout (checkpoint.json's and provenance's `drafter`).

    {<shared fields>, "architecture": "dflash2", "dflash2": {<DFlash2Options>}}

A member's options are a frozen dataclass it declares (`DrafterOptions`, its `options_type`),
stored nested under the member's name, so that a shared field and an option of the same name
never meet. Plain DFlash (no options) writes neither key, as before the family existed. Records
written before the nesting hold a member's options flat beside the shared fields;
`nested_record` moves them under the member's name, taking only the keys the member declares.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

from dflash_pipeline.drafters import family


@dataclass(frozen=True)
class DrafterOptions:
    """The base of every member's options (`Architecture.options_type`): a frozen dataclass whose
    fields size the drafter beyond the shared ones. This base itself holds none."""


class DrafterSizeError(ValueError):
    """An architecture option that does not fit the drafter's sizes (`Architecture.check`): the
    option's key, why, and its value, so that a caller can name the key where it was set."""

    def __init__(self, key: str, why: str, value):
        super().__init__(f"{key} {value} {why}")
        self.key, self.why, self.value = key, why, value


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int  # B: slot 0 is the anchor, slots 1..B-1 are drafted
    target_layer_ids: tuple[int, ...]  # id i = output of target decoder layer i
    num_target_layers: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    sliding_window: int | None = None  # context keys further back than this are not attended
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)  # recorded, not used: e.g. how the mask token was chosen
    architecture: str = family.UNNAMED  # a member of `drafters.family`
    # The architecture's own options, always its `options_type` once constructed: None or a mapping
    # given here is resolved to it, with the member's defaults for what is not given.
    options: DrafterOptions | Mapping | None = None

    def __post_init__(self):
        member = family.architecture(self.architecture)
        object.__setattr__(self, "options", member.options_from(self.options))
        problem = member.check(self)
        if problem:
            key, why = problem
            raise DrafterSizeError(key, why, getattr(self.options, key, None))

    @property
    def member(self):
        """The architecture (`drafters.architecture.Architecture`) this config belongs to."""
        return family.architecture(self.architecture)

    @property
    def feature_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def shared_fields(cls) -> set[str]:
        """The keys every member has, at the top level of the record."""
        return {f.name for f in fields(cls)} - {"architecture", "options"}

    def to_dict(self) -> dict:
        """The shared fields, then the architecture's name and, nested under that name, its options
        (a DFlash config leaves both out, so its record is what it was before the family existed)."""
        data = asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        del data["architecture"], data["options"]
        if self.architecture != family.UNNAMED or asdict(self.options):
            data["architecture"] = self.architecture
            data[self.architecture] = asdict(self.options)
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> "DrafterConfig":
        """The inverse of `to_dict`; a record written before the options were nested loads too
        (`nested_record`). A key that is neither shared nor the member's is a ValueError naming it."""
        data = nested_record(data)
        name = data.pop("architecture", family.UNNAMED)
        family.architecture(name)  # an unknown name is named before its keys are
        options = data.pop(name, None)
        unknown = sorted(set(data) - cls.shared_fields())
        if unknown:
            raise ValueError(f"no drafter config key {unknown[0]!r} (architecture {name!r})")
        data["target_layer_ids"] = tuple(data["target_layer_ids"])
        return cls(**data, architecture=name, options=options)


def nested_record(data: Mapping) -> dict:
    """A serialised drafter config in the current layout. One written before a member's options
    were nested holds them flat beside the shared fields: the keys the member declares move under
    its name (a shared field added since under the same name did not exist when it was written).
    A record already nested, or naming no known member, comes back as it is."""
    data = dict(data)
    name = data.get("architecture", family.UNNAMED)
    if name in data or name not in family.names():
        return data
    declared = [f.name for f in fields(family.architecture(name).options_type)]
    options = {key: data.pop(key) for key in declared if key in data}
    if options or name != family.UNNAMED:
        data[name] = options
    return data
