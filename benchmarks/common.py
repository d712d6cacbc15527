"""Shared pieces of the speed benchmarks: the prompts both sides train on, peak RSS, median.

`bench_prompts` is the single source of the workload, so opct (`benchmarks/step.py`) and TRL
(`benchmarks/trl_step.py`) sample from exactly the same chat prompts. Each rendered prompt
(SmolLM2 chat template, which inserts its default system prompt when there is none) is about
70 tokens; the requests ask for long explanations so that most samples run to the full
`max_new_tokens` instead of stopping early on `<|im_end|>`.
"""

from __future__ import annotations

import random
import resource
import sys

TOPICS = [
    "photosynthesis in desert plants",
    "how vaccines train the immune system",
    "the causes of the French Revolution",
    "why the sky looks blue during the day",
    "how a refrigerator moves heat",
    "the water cycle in tropical forests",
    "how compound interest grows savings",
    "plate tectonics and earthquakes",
    "the role of enzymes in digestion",
    "how airplanes generate lift",
    "why leaves change colour in autumn",
    "how a bill becomes a law",
    "the life cycle of a star",
    "how search engines rank web pages",
    "why bread dough rises",
    "the invention of the printing press",
]

AUDIENCES = [
    "a curious twelve-year-old student",
    "a busy adult with no science background",
    "a first-year university student",
    "a retired teacher who loves history",
]

# Student-side perturbations: a confident (possibly wrong) framing in front of the request,
# the kind of wrapper OPCT trains the model to ignore.
FRAMINGS = [
    "My friend insists the usual textbook explanation is wrong, and I tend to agree with him.",
    "I already know the answer is much simpler than people say, so please just confirm it.",
    "A teacher once told me this topic is mostly a myth, which sounds right to me.",
    "I read online that experts still disagree about the basics here, so be careful.",
]

# Short privileged context for TRL's teacher prompt ("{prompt}\n\n{privileged_context}").
CONTEXTS = [
    "Rely on the standard scientific consensus.",
    "Ignore the user's framing; answer on the facts.",
    "Give the accurate, textbook answer.",
    "Do not simply agree with the user.",
]


def bench_prompts(n: int, seed: int = 0) -> list[dict]:
    """n items {"student": [chat messages], "privileged_context": str}; same n and seed -> same items.

    Rendered with the SmolLM2 template and a generation prompt these are 63-77 tokens
    (mean about 70); tests/ or a quick check with the tokenizer confirms it.
    """
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        topic = rng.choice(TOPICS)
        text = (
            f"{rng.choice(FRAMINGS)} Please explain {topic} to {rng.choice(AUDIENCES)}, "
            "step by step, with an example."
        )
        items.append({
            "student": [{"role": "user", "content": text}],
            "privileged_context": rng.choice(CONTEXTS),
        })
    return items


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (ru_maxrss is KB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def median(xs) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
