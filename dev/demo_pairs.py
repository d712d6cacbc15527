"""Write the training pairs a default `opct demo --axis AXIS` trains on (its pairs.jsonl), without running it: what
`opct check` reads in the lens acceptance (docs/lens.md).

    python dev/demo_pairs.py sycophancy OUT.jsonl [--model M] [demo options, e.g. --n-train 64]
"""

from __future__ import annotations

import argparse
import sys

from opct import config, models, options
from opct.axes import axis_defaults, get_axis
from opct.data.pairs import save_pairs


def main(argv: list[str]) -> None:
    axis, out, rest = argv[0], argv[1], argv[2:]
    p = argparse.ArgumentParser(prog="demo_pairs")
    options.add_arguments(p, config.DemoConfig)
    cfg = config.build(config.DemoConfig, p.parse_args(["--axis", axis, *rest]), defaults=axis_defaults)
    _, tok = models.load_model(cfg.model)
    data = get_axis(axis).prepare(cfg, tok)
    save_pairs(data.train_pairs, out)
    print(f"{len(data.train_pairs)} {axis} pairs -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
