"""Question sets for the consistency axes (multiple-choice items and their loaders)."""
