"""The nn models and modules: semantics, training features, schedules, decoding, torch.compile, the demo."""
