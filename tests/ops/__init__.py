"""The public ops (depth read, attention, Block step) on every backend against the reference."""
