"""The registry of drafter architectures: the one list of what `train.architecture` may name.

An architecture (`drafters.architecture.Architecture`) owns everything that differs between
drafters: its options and their checks, its layers around the shared core, how it drafts a chain
or a tree, any extra loss term and scores, and its names in the serving format. Shared code asks
the member it is handed (`architecture(config.architecture)`), never tests a name.

The members register themselves when their module is imported; `drafters/__init__.py` imports
every member, so importing anything from the wing makes the whole family known. A test can add a
member of its own with `registered(...)`.
"""

from contextlib import contextmanager

_MEMBERS: dict = {}  # name -> Architecture, in registration order

# A serialised drafter config that names no architecture was written before the family existed:
# it is plain DFlash.
UNNAMED = "dflash"
# The member a train config gets when it names none (params.yaml names it explicitly): DFlash2,
# +0.10 τ over DFlash at equal CPU time (docs/studies.md).
DEFAULT = "dflash2"


def register(member) -> None:
    """Add an architecture; its `name` and `public_class` must be new."""
    if member.name in _MEMBERS:
        raise ValueError(f"architecture {member.name!r} is already registered")
    if any(other.public_class == member.public_class for other in _MEMBERS.values()):
        raise ValueError(f"public class {member.public_class!r} already belongs to another architecture")
    _MEMBERS[member.name] = member


def unregister(name: str) -> None:
    _MEMBERS.pop(name, None)


@contextmanager
def registered(member):
    """`member` is part of the family inside the block (tests register a member of their own)."""
    register(member)
    try:
        yield member
    finally:
        unregister(member.name)


def names() -> list[str]:
    return list(_MEMBERS)


def architecture(name: str):
    """The member called `name`; ValueError naming the known ones otherwise."""
    try:
        return _MEMBERS[name]
    except KeyError:
        raise ValueError(f"architecture must be one of {', '.join(_MEMBERS)}, got {name!r}") from None


def by_public_class(public_class: str):
    """The member whose serving-format class name (config.json `architectures`) is `public_class`, or None."""
    return next((member for member in _MEMBERS.values() if member.public_class == public_class), None)


def public_classes() -> list[str]:
    return [member.public_class for member in _MEMBERS.values()]
