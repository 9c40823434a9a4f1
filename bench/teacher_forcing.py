"""Teacher-forced next-token accuracy of a built-in model, by task kind and answer position.

For answer position j, the gold response before j is visible and positions j.. are masked; the
model's argmax at j is compared with the gold token (24 training-split problems a kind, seed 5).
This separates what a model has learned (copies, formats, arithmetic) from decoding effects.

    python bench/teacher_forcing.py models/llada-tiny
"""

from __future__ import annotations

import sys

import torch

from engine import load_model
from tinymodels.tasks import KINDS, sample
from tinymodels.train import encode_examples

PER_KIND = 24
SHOWN_POSITIONS = 24


@torch.no_grad()
def main(model_dir: str) -> None:
    model = load_model(model_dir)
    model.eval()
    drawn = sample(400, 5, "train")
    for kind in KINDS:
        problems = [p for p in drawn if p.kind == kind][:PER_KIND]
        ids, attention, _ = encode_examples(problems, 128)
        start = ids.shape[1] - 128
        longest = max(len(p.response) for p in problems)
        correct, total = torch.zeros(longest), torch.zeros(longest)
        for j in range(longest):
            noisy = ids.clone()
            noisy[:, start + j:] = model.special.mask_id
            logits = model(noisy, attention_mask=attention)
            if model.logits_shifted:  # Dream: output i-1 predicts token i
                logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
            hit = logits[:, start + j].argmax(-1) == ids[:, start + j]
            valid = torch.tensor([j < len(p.response) for p in problems])
            correct[j], total[j] = (hit & valid).sum(), valid.sum()
        shown = zip(correct[:SHOWN_POSITIONS], total[:SHOWN_POSITIONS], strict=True)
        by_position = " ".join(f"{c / t:.1f}" for c, t in shown)
        print(f"{kind:8s} {correct.sum() / total.sum():.3f}   first positions: {by_position}")


if __name__ == "__main__":
    main(sys.argv[1])
