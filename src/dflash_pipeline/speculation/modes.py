"""The decoding mode: a chain with its verify length, or a DDTree with its node budget.

One type from end to end: `evaluate` decodes and records modes by it (`record.BestMode`), the
export carries its JSON form in its provenance (`source.best_mode`), and `dflash-pipeline decode`
reads it back. Its name ("chain", "tree8") is the key of the per-mode figures in eval.json; the
name is made and read here and nowhere else.
"""

from dataclasses import dataclass

from dflash_pipeline.foundation.errors import PipelineError

CHAIN = "chain"
TREE = "tree"


@dataclass(frozen=True)
class DecodingMode:
    """A greedy or sampled chain of drafted tokens (`verify_tokens` of them verified, None: all
    B-1), or a greedy DDTree of `tree_budget` drafted nodes. Never both."""

    tree_budget: int | None = None
    verify_tokens: int | None = None

    def __post_init__(self):
        for key in ("tree_budget", "verify_tokens"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{key} is {value!r}, expected an integer >= 1")
        if self.tree_budget is not None and self.verify_tokens is not None:
            raise ValueError("a tree verifies its whole budget: a mode has a tree budget or a verify length, not both")

    @classmethod
    def chain(cls, verify_tokens: int | None = None) -> "DecodingMode":
        return cls(verify_tokens=verify_tokens)

    @classmethod
    def tree(cls, budget: int) -> "DecodingMode":
        return cls(tree_budget=budget)

    @property
    def is_tree(self) -> bool:
        return self.tree_budget is not None

    @property
    def name(self) -> str:
        """"chain" or "tree<budget>": the key of this mode's figures."""
        return f"{TREE}{self.tree_budget}" if self.is_tree else CHAIN

    @classmethod
    def parse(cls, name: str, *, verify_tokens: int | None = None, where: str = "mode") -> "DecodingMode":
        """The mode a name spells ("chain" with an optional verify length, or "tree<budget>");
        anything else is one error naming `where`."""
        if name == CHAIN:
            return cls.chain(verify_tokens)
        budget = name[len(TREE):] if isinstance(name, str) and name.startswith(TREE) else ""
        if not (budget.isascii() and budget.isdigit()) or budget.startswith("0"):
            raise PipelineError(f"{where} is {name!r}, expected '{CHAIN}' or '{TREE}<budget>'")
        return cls.tree(int(budget))

    def describe(self, block_size: int) -> str:
        """In words, for a drafter of `block_size` (B-1 drafted tokens per block)."""
        if self.is_tree:
            return f"DDTree budget {self.tree_budget}"
        drafted = block_size - 1
        if self.verify_tokens is None or self.verify_tokens >= drafted:
            return f"chain of all {drafted} drafted tokens"
        return f"chain verifying {self.verify_tokens} of {drafted} drafted tokens"

    def as_dict(self) -> dict:
        """The JSON form: {"mode": name, "verify_tokens": ..., "tree_budget": ...}."""
        return {"mode": self.name, "verify_tokens": self.verify_tokens, "tree_budget": self.tree_budget}

    @classmethod
    def from_dict(cls, section: dict, where: str) -> "DecodingMode":
        """`as_dict`'s form read back, checked: a malformed record is one error naming `where` and the key."""
        if not isinstance(section, dict):
            raise PipelineError(f"{where} is {type(section).__name__}, expected a mapping")

        def whole(key: str) -> int | None:
            value = section.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PipelineError(f"{where}.{key} is {value!r}, expected an integer >= 1")
            return value

        mode = cls.parse(section.get("mode"), where=f"{where}.mode")
        if mode.is_tree:
            budget = whole("tree_budget")
            if budget != mode.tree_budget:
                raise PipelineError(f"{where}: mode {mode.name!r} and tree_budget {section.get('tree_budget')!r} disagree")
            return mode
        return cls.chain(whole("verify_tokens"))
