"""lm-eval's model interface on an opct `Policy`: capability tasks run through the same execution seam as training
and the axes, on whatever backend, device and dtype the policy was built for.

    loglikelihood          -> policy.continuation_logprobs(contexts, continuations)   (a context's choices share
                                                                                      its forward)
    loglikelihood_rolling  -> the same, over lm-eval's rolling windows of the text
    generate_until         -> policy.generate(contexts, greedy or sampled settings), cut at the task's stop strings

Text becomes tokens exactly as lm-eval's own HF model (`HFLM`) makes them, so that both read the same token ids:
`TemplateLM._encode_pair` (a context's trailing spaces move to its continuation; the pair is encoded whole and
split), the tokenizer's own special tokens (none added where the text already starts with BOS), an empty context
replaced by the prefix token (BOS, else EOS), contexts left-truncated to the model's length. The log-probs are the
policy's: the cpu backend's kernels or transformers', in the policy's dtype; on the same model in float32 they equal
HFLM's up to float rounding (tests/evals/test_policy_lm.py). Generation decodes greedily (or samples with the task's
temperature from a generator seeded with `seed`) for `max_gen_toks` tokens or up to EOS, then cuts the text at the
first stop string, as HFLM's stopping criteria do. A thinking model (reasoning tags in the model's `ChatFormat`,
opct.data.chat) is graded on the answer after its reasoning; one whose reasoning does not close within the budget
answers "". Chat-formatted tasks render their chats with the same format's template options.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from opct.backends.sampling import SamplingSettings


class PolicyLM(TemplateLM):
    """An lm-eval LM over `policy` (an opct inference policy) and its model's chat format `fmt`
    (opct.data.chat.ChatFormat: the template options for chat texts, where an answer starts), the pair
    `opct.backends.inference_model` returns."""

    backend = "causal"

    def __init__(self, policy, fmt, batch_size: int = 16, max_length: int | None = None, max_gen_toks: int = 256,
                 seed: int = 0):
        super().__init__()
        self.policy, self.fmt, self.tokenizer = policy, fmt, policy.tok
        self.batch_size, self.max_gen_toks, self.seed = int(batch_size), max_gen_toks, seed
        config = getattr(getattr(policy, "model", None), "config", None)
        self.max_length = max_length or getattr(config, "max_position_embeddings", None) or 2048

    # -- tokens, as HFLM makes them --------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kw = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **kw)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.fmt.text(chat_history, add_generation_prompt)

    # -- requests ----------------------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        prompts, conts = [], []
        for _, context_enc, continuation_enc in requests:
            whole = (context_enc + continuation_enc)[-(self.max_length + 1):]  # as HFLM: the last max_length + 1
            prompts.append(whole[:len(whole) - len(continuation_enc)])
            conts.append(whole[len(whole) - len(continuation_enc):])
        got = self.policy.continuation_logprobs(prompts, conts, batch_size=self.batch_size)
        out = [(float(logp.sum()), bool(greedy.all())) for logp, greedy in got]
        for (key, _, _), r in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, r)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for w in get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                               max_seq_len=self.max_length, context_len=1):
                context, cont = make_disjoint_window(w)
                windows.append((None, context, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list = [None] * len(requests)
        eos = self.tokenizer.decode(self.eot_token_id)
        by_kwargs: dict = {}  # one generate call per distinct settings, as HFLM groups its batches
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            n = kw.pop("max_gen_toks")
            temperature = float(kw.get("temperature") or 0.0) if kw.get("do_sample") else 0.0
            key = (tuple(until), n, temperature, float(kw.get("top_p") or 1.0), int(kw.get("top_k") or 0))
            by_kwargs.setdefault(key, []).append((i, context))
        thinks = self.fmt.thinks
        for (until, n, temperature, top_p, top_k), items in by_kwargs.items():
            if n >= self.max_length:
                raise ValueError(f"max_gen_toks {n} leaves no room for a prompt in the model's {self.max_length}")
            prompts = [self.tok_encode(c)[-(self.max_length - n):] for _, c in items]
            got = self.policy.generate(prompts, SamplingSettings(n, temperature, top_p, top_k),
                                       torch.Generator().manual_seed(self.seed), batch_size=self.batch_size)
            for (i, context), p, r in zip(items, prompts, got):
                if thinks:  # a thinking model: grade the answer after its reasoning
                    r = self.fmt.split(p, r).answer
                text = self.tokenizer.decode(r, skip_special_tokens=True)
                text = postprocess_generated_text(text.lstrip() if thinks else text, list(until), None)
                out[i] = text
                self.cache_hook.add_partial("generate_until", (context, requests[i].args[1]), text)
        return out
