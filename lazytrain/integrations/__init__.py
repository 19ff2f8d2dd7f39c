"""Bridges from the stacks people already run (DeepSpeed-based trainers) to LazyTrain."""
