"""Shared fixtures: a tiny random Llama with the real SmolLM2 tokenizer (fast, deterministic, no network)."""

from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
TOKENIZER_DIR = FIXTURES / "smollm2-tokenizer"

torch.set_num_threads(2)


def make_tiny_model(path: Path, seed: int = 0, layers: int = 2, hidden: int = 32) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # Larger-than-default init so the random model has peaked, prompt-dependent next-token distributions.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def lora_model(model_dir, std: float = 0.2, seed: int = 0):
    """The model in model_dir (eval mode) with a rank-4 LoRA adapter whose B is drawn from N(0, std^2): a nonzero
    adapter, so a missing or mis-scaled LoRA term shows."""
    from opct.models import add_lora, load_model

    model, tok = load_model(str(model_dir))
    model = add_lora(model, 4, 8.0)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    return model.eval(), tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)
