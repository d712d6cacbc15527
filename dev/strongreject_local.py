"""The StrongREJECT rubric answered by a local model, for real, on two outputs of dev/jailbreak_wrappers.py (one
bare refusal, one prefix-injection compliance). Qwen2.5-Coder-0.5B-Instruct as its own judge: shows the local path
runs end to end and that an unparseable judge answer is kept and counted.

    OMP_NUM_THREADS=1 nice -n 10 python dev/strongreject_local.py
"""
import json, time, torch
torch.set_num_threads(1)
from opct.models import load_model
from opct.judges.strongreject import StrongRejectJudge
from opct.judges.refusal import RefusalJudge
d = json.load(open("benchmarks/results/jailbreak_wrappers-qwen05.json"))
items = {it["id"]: it for it in d["items"]}
pick = [items["bare/advbench/442"], items["prefix_injection/advbench/172"]]
model, tok = load_model("qwen2.5-coder-0.5b-instruct")
j = StrongRejectJudge.from_local_model(model, tok, max_new_tokens=320)
t = time.time()
v = j.judge([p["request"] for p in pick], [p["response"] for p in pick])
r = RefusalJudge().judge([p["request"] for p in pick], [p["response"] for p in pick])
print("seconds", round(time.time() - t, 1))
for p, x, y in zip(pick, v, r):
    print(p["id"], "| strongreject:", x.label, x.score, x.details, "| regex:", y.label)
    print("RAW:", repr(x.raw[:1500]))
