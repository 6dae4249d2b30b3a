"""The decoding wing: sampling rules, draft trees, and the engine that decodes with the target."""
