"""Experiments on the shared engine: each brings its data, model, evaluation and report."""
