"""The data wing: prompt sets, the Arrow shard contract, and the packed blocks a drafter trains and is scored on."""
