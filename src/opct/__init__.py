"""opct: On-Policy Consistency Training of language models."""

__version__ = "0.1.0"
