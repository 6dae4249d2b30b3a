"""The host DDTree: the heap builder and the tree mask the static step's tensor builder is tested against."""

from dflash_pipeline.decoding.trees import ANCHOR, DraftTree, build_draft_tree, tree_attention_mask, tree_positions  # noqa: F401  moved next
