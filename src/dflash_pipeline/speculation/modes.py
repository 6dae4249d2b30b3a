"""The decoding mode: a chain with its verify length, or a DDTree with its node budget.

One type from end to end: the decoding session and its speculative step are built from it
(`decoding.session`), `evaluate` decodes, keys and records modes by it (`record.BestMode`), the
export carries its JSON form in its provenance (`source.best_mode`), and `dflash-pipeline decode`
reads it back. Its name ("chain", "tree8") is the key of the per-mode figures in eval.json; the
name, the JSON form and the one rule of a tree (`check_tree_rule`) are made and read here and
nowhere else.
"""

from dataclasses import dataclass

from dflash_pipeline.foundation.errors import PipelineError

CHAIN = "chain"
TREE = "tree"
RUN_SEPARATOR = "/"  # "<candidate>/tree8": a candidate's tree run, as e2e.json names it


def check_tree_rule(*, tree_budget: int | None, verify_tokens: int | None, sampled: bool,
                    names: tuple[str, str, str] = ("tree_budget", "verify_tokens", "sampling")) -> None:
    """The one rule of a tree: it verifies the whole tree (no verify length) and greedily (its
    acceptance is lossless at T = 0 only, so no sampling). A setting against it is one error
    naming the settings as `names` spells them (tree budget, verify length, sampling): the
    keywords by default, the console command's options where it checks what a user typed."""
    if tree_budget is None:
        return
    tree, verify, sampling = names
    given = [name for name, is_set in ((sampling, sampled), (verify, verify_tokens is not None)) if is_set]
    if given:
        raise PipelineError(f"{tree}: tree verification is greedy and verifies the whole tree (drop {' / '.join(given)})")


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
        check_tree_rule(tree_budget=self.tree_budget, verify_tokens=self.verify_tokens, sampled=False)

    @classmethod
    def chain(cls, verify_tokens: int | None = None) -> "DecodingMode":
        return cls(verify_tokens=verify_tokens)

    @classmethod
    def tree(cls, budget: int) -> "DecodingMode":
        return cls(tree_budget=budget)

    @classmethod
    def of(cls, *, tree_budget: int | None, verify_tokens: int | None, sampled: bool, names: tuple[str, str, str]) -> "DecodingMode":
        """The mode of settings a user gave (a tree budget or a verify length, sampled or not),
        checked by `check_tree_rule` under the settings' own `names` (the console command's options)."""
        check_tree_rule(tree_budget=tree_budget, verify_tokens=verify_tokens, sampled=sampled, names=names)
        return cls(tree_budget=tree_budget, verify_tokens=verify_tokens)

    def check_sampling(self, sampling) -> None:
        """This mode against a decode's `sampling` (None: greedy), by `check_tree_rule`: a sampled
        tree is refused. The speculative step calls it once, when it is built."""
        check_tree_rule(tree_budget=self.tree_budget, verify_tokens=self.verify_tokens, sampled=sampling is not None)

    @property
    def is_tree(self) -> bool:
        return self.tree_budget is not None

    def for_block(self, block_size: int) -> "DecodingMode":
        """This mode for a drafter of `block_size`: a chain verifies at most its B-1 drafted tokens."""
        if self.verify_tokens is None or self.verify_tokens <= block_size - 1:
            return self
        return DecodingMode.chain(block_size - 1)

    def verified(self, drafted: int) -> tuple[int, int]:
        """(nodes one step verifies, the most levels an accepted path has) for a drafter of
        `drafted` = B-1 slots: a tree its budget over at most B-1 levels, a chain its verify
        length (all B-1 when None, at most B-1) one node per level."""
        if self.is_tree:
            return self.tree_budget, min(drafted, self.tree_budget)
        nodes = min(self.verify_tokens or drafted, drafted)
        return nodes, nodes

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

    def run_name(self, candidate: str) -> str:
        """A candidate's runs in this mode as e2e.json names them: the candidate's own name for a
        chain (greedy or sampled), "<candidate>/tree<budget>" for a tree."""
        return f"{candidate}{RUN_SEPARATOR}{self.name}" if self.is_tree else candidate

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

    @staticmethod
    def dict_of(mode: "DecodingMode | None") -> dict:
        """`as_dict` of `mode`, or, for no mode (a record that found none), the same keys all null."""
        return mode.as_dict() if mode is not None else {"mode": None, "verify_tokens": None, "tree_budget": None}

    @classmethod
    def from_dict(cls, section: dict, where: str, *, optional: bool = False) -> "DecodingMode | None":
        """`as_dict`'s form read back, checked: a malformed record is one error naming `where` and
        the key. `optional`: a null mode (`dict_of(None)`) reads back as None."""
        if not isinstance(section, dict):
            raise PipelineError(f"{where} is {type(section).__name__}, expected a mapping")
        if optional and section.get("mode") is None:
            return None

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
