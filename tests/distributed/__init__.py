"""Distributed training of the nn models on CPU (gloo): DDP, FSDP2, pipelines, tensor parallel, checkpoints."""
