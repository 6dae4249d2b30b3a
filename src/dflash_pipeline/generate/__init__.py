"""The generate stage: the target answers the prompt set."""
