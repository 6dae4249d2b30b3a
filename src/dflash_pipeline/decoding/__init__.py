"""The decoding wing: the one engine that decodes with the target. Outside code enters through two
modules: `plain` (the target alone) and `session` (speculative decoding with a drafter)."""
