"""A few checks on the embedded SmolLM2-135M-Instruct; skipped when its PyPI package cannot be installed."""

import json
from pathlib import Path

import pytest
import torch

from opct.models import SMOLLM2, ModelError, find_embedded_gguf

pytestmark = pytest.mark.real_model
EXAMPLES = Path(__file__).parent.parent / "examples" / "pairs.jsonl"


@pytest.fixture(scope="module")
def smollm2():
    try:
        find_embedded_gguf(SMOLLM2)
    except ModelError as e:
        pytest.skip(f"embedded model unavailable: {e}")
    from opct.models import load_model

    return load_model(SMOLLM2["alias"])


def test_alias_loads_a_dense_trainable_model(smollm2):
    model, tok = smollm2
    assert model.dtype == torch.float32 and getattr(model, "hf_quantizer", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


def test_one_opct_step_on_the_real_model(smollm2, tmp_path):
    from opct.config import TrainConfig
    from opct.algo.opct import train

    out = tmp_path / "run"
    train(TrainConfig(model=SMOLLM2["alias"], pairs=str(EXAMPLES), out=str(out), steps=1, prompts_per_step=2,
                      micro_batch=2, max_new_tokens=8, report_to="none"), show_progress=False)
    row = json.loads((out / "metrics.jsonl").read_text())
    # the cue changes the model's distribution, so the teacher assigns the student's tokens lower probability
    assert 0 < row["response_len"] <= 8 and row["kl"] == row["kl"] and row["logp_student"] > row["logp_teacher"] - 5
    assert (out / "model" / "adapter_config.json").is_file()
