"""Fused ops, one folder each: a torch reference, the math, the autograd Function, the op."""
