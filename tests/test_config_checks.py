"""config.validate accepts and refuses what it did, with the same messages: the snapshot
tests/fixtures/validate_outcomes.json holds, for every command's config, each field set alone to each value of a
grid (bounds, NaN/inf, blank and malformed text) plus the cross-field cases below, the message of each refused
one; every other case is accepted.

The snapshot was written from commit 4192c45's validate (before the per-field checks moved onto the fields). After
a deliberate change of a rule, rewrite it and review the diff:

    OPCT_WRITE_VALIDATE_SNAPSHOT=1 PYTHONPATH=src python -m pytest -q tests/test_config_checks.py
"""

import dataclasses
import json
import math
import os
from pathlib import Path

from opct import config

SNAPSHOT = Path(__file__).parent / "fixtures" / "validate_outcomes.json"
CLASSES = (config.TrainConfig, config.SFTConfig, config.EvalConfig, config.DemoConfig)

INTS = (-1, 0, 1, 2, 512, 513, 2 ** 32 - 1, 2 ** 32)
FLOATS = (math.nan, math.inf, -math.inf, -1.0, 0.0, 0.5, 1.0, 1.5, 2.0)
TEXTS = ("", " ", "x", "1", "null", "auto", "none", "harmony", "<think>", "<think>,</think>", "a, ", "a,b", "{", "{}",
         "[]", '{"enable_thinking": true}', '{"messages": []}', '{"tokenize": true, "conversation": 1}', "0.9,0.999",
         "0.9", "1,0.5", "urgent", "urgent,emotional", "urgent,shouting", "prefill", "prefill,multiturn", "bogus",
         "wandb", "tensorboard,none")

# several fields at once: the rules between fields
CROSS = [
    (config.TrainConfig, {"fixed_advantage": -1.0, "loss": "full"}),
    (config.TrainConfig, {"fixed_advantage": -1.0, "teacher_context": "shuffled"}),
    (config.TrainConfig, {"fixed_advantage": -1.0, "loss": "sampled", "teacher_context": "clean"}),
    (config.TrainConfig, {"fixed_advantage": math.nan, "loss": "full"}),
    (config.TrainConfig, {"sampler": "vllm", "lora_rank": 513}),
    (config.TrainConfig, {"sampler": "vllm-server", "lora_rank": 513}),
    (config.TrainConfig, {"sampler": "vllm", "lora_rank": 512}),
    (config.TrainConfig, {"sampler": "policy", "lora_rank": 513}),
    (config.TrainConfig, {"sampler": "vllm", "lora_rank": -1}),
    (config.DemoConfig, {"sampler": "vllm", "lora_rank": 513}),
    (config.DemoConfig, {"seed": 2 ** 32 - 1, "seeds": 2}),
    (config.DemoConfig, {"seed": 2 ** 32 - 2, "seeds": 2}),
    (config.DemoConfig, {"seed": -1, "seeds": 3}),
    (config.DemoConfig, {"seed": 0, "seeds": 0}),
    (config.DemoConfig, {"seed": -1, "seeds": 0}),
    (config.EvalConfig, {"tasks": "arc_easy", "limit": -1}),
    (config.EvalConfig, {"axis": "safety", "heldout_variants": "urgent,emotional,curious"}),
]


def grid(cls):
    """(field, value) for every field of cls and every value of its type's grid."""
    for f in dataclasses.fields(cls):
        kind = config._kind(f)
        for v in {int: INTS, float: FLOATS, str: TEXTS}.get(kind, ()):
            yield f.name, v


def outcome(cls, values: dict):
    try:
        config.validate(cls(**values))
    except Exception as e:  # noqa: BLE001 - the snapshot records whatever it raised
        return f"{type(e).__name__}: {e}"
    return None


def outcomes() -> dict:
    """{class: {field=repr(value): what validate raised}} for the refused grid cases; "cross" for CROSS's."""
    out = {}
    for cls in CLASSES:
        refused = {}
        for name, v in grid(cls):
            got = outcome(cls, {name: v})
            if got is not None:
                refused[f"{name}={v!r}"] = got
        out[cls.__name__] = refused
    out["cross"] = {f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in values.items())})": outcome(cls, values)
                    for cls, values in CROSS}
    return out


def test_validate_refuses_what_it_did_with_the_same_messages():
    now = outcomes()
    if os.environ.get("OPCT_WRITE_VALIDATE_SNAPSHOT") == "1":
        SNAPSHOT.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    then = json.loads(SNAPSHOT.read_text())
    for key in then:
        assert set(now[key]) == set(then[key]), f"{key}: refused other cases"
        for case, message in then[key].items():
            assert now[key][case] == message, f"{key} {case}"
    assert set(now) == set(then)


def test_the_defaults_are_valid():
    for cls in CLASSES:
        assert config.validate(cls()) == cls()
