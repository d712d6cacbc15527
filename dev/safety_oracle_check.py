"""Oracle vs plain on the safety axis: does the base model warn more often with the fact in its system prompt?

Generates greedy responses to the ORIGINAL variant of the first naive prompt of each fact, once plain (the
student's view) and once after the teacher system prompt (the "oracle"), plus contrast prompts plain, and
scores them all with the keyword judge. Writes one JSONL row per response (for hand labelling) and prints
pass rates. Run it niced, on one thread (the responses behind tests/fixtures/safety_hand_labels.jsonl):

    OMP_NUM_THREADS=1 nice -n 10 python dev/safety_oracle_check.py --model smollm2-135m-instruct \
        --n-facts 49 --n-contrast 12 --out /tmp/safety_responses_smollm2.jsonl
    OMP_NUM_THREADS=1 nice -n 10 python dev/safety_oracle_check.py \
        --model ~/.cache/opct/models/qwen2.5-coder-0.5b-instruct --n-facts 30 --n-contrast 10 --out /tmp/q.jsonl

--teacher-mode user puts the fact in the user's message instead of the system prompt (the authors' other mode).
"""

import argparse
import json
import time

import torch

from opct.axes.safety.facts import generate_prompts, load_facts
from opct.axes.safety.judges import KeywordJudge
from opct.models import load_model
from opct.data.chat import render_prompt


def generate(model, tok, chats, max_new_tokens, batch):
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    out = []
    for i in range(0, len(chats), batch):
        ids = [render_prompt(tok, m) for m in chats[i:i + batch]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            gen = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        out += [tok.decode(g[width:], skip_special_tokens=True).strip() for g in gen]
        print(f"  {len(out)}/{len(chats)}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n-facts", type=int, default=49)
    ap.add_argument("--n-contrast", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--teacher-mode", default="system", choices=("system", "user"))
    ap.add_argument("--conditions", default="plain,oracle,contrast")
    a = ap.parse_args()
    torch.set_num_threads(1)
    facts = load_facts()
    by_id = {f.id: f for f in facts}
    prompts = generate_prompts(facts, variants=("original",))
    naive = [p for p in prompts if not p.contrast and p.id.split("/")[1].endswith("0")][:a.n_facts]
    contrast = [p for p in prompts if p.contrast and p.id.split("/")[1] == "contrast0"][:a.n_contrast]
    conds = a.conditions.split(",")
    jobs = ([(p, "plain") for p in naive] * ("plain" in conds) + [(p, "oracle") for p in naive] * ("oracle" in conds)
            + [(p, "contrast") for p in contrast] * ("contrast" in conds))
    model, tok = load_model(a.model)
    t0 = time.time()
    responses = generate(model, tok, [p.messages(oracle=(c == "oracle"), mode=a.teacher_mode) for p, c in jobs], a.max_new_tokens, a.batch)
    verdicts = KeywordJudge().judge([p.text for p, _ in jobs], responses, [by_id[p.fact_id] for p, _ in jobs])
    with open(a.out, "w") as f:
        for (p, cond), r, v in zip(jobs, responses, verdicts):
            f.write(json.dumps({"id": f"{p.id}#{cond}", "prompt_id": p.id, "fact_id": p.fact_id, "condition": cond,
                                "teacher_mode": a.teacher_mode if cond == "oracle" else None,
                                "model": a.model, "prompt": p.text, "response": r, "keyword_pass": v.passed,
                                "keyword_reason": v.reason}) + "\n")
    for cond in ("plain", "oracle", "contrast"):
        vs = [v.passed for (_, c), v in zip(jobs, verdicts) if c == cond]
        if vs:
            print(f"{cond}: keyword pass {sum(vs)}/{len(vs)} = {sum(vs) / len(vs):.3f}")
    print(f"generation wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
