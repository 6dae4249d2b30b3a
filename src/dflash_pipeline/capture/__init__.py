"""The capture stage: one target forward per sequence into Arrow shards."""
