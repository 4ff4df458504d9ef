"""Integrations with the training stacks people use: HF ``Trainer`` (:mod:`.hf`), Lightning (:mod:`.lightning`).

Each module imports its framework only when imported itself.
"""
